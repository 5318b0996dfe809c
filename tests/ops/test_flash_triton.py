"""backend="triton" flash attention on CPU through the Triton interpreter (TRITON_INTERPRET=1).

Every feature at tiny odd sizes, fp16 (the interpreter's bf16 tl.dot is broken), against the float64
reference with the error rule of docs/TESTING.md (forward 2x, gradients 3x the error of the same computation
in fp16), outputs poisoned with NaN before the kernels write them.
"""
import pytest
import torch

import delta_attn as da
from delta_attn import reference
from delta_attn.backends import UnsupportedError
from delta_attn.testing import assert_close

pytest.importorskip("triton")
DT = torch.float16


def _inputs(shapes, dtype=DT, scale=1.0):
    return [(torch.randn(s, dtype=torch.float32) * scale).to(dtype).requires_grad_() for s in shapes]


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


def _check_all(got, ref64, reflow, names):
    for g, r, l, n in zip(got, ref64, reflow, names):
        assert_close(g, r, l, kind="grad" if n.startswith("d") else "fwd", name=n)


def _compare_dense(q, k, v, *, dropout_mask=None, **kw):
    """Run ours and the reference (float64 and fp16) and check out, lse, dq, dk, dv."""
    out, lse, none = da.flash_attn_func(q, k, v, return_attn_probs=True, backend="triton", **kw)
    assert none is None and lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    rkw = {n: kw[n] for n in ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "dropout_p")
           if n in kw}
    res = {}
    for name, dt, up in (("64", torch.float64, True), ("low", q.dtype, False)):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, l = reference.attention(*xs, dropout_mask=dropout_mask, upcast=up, **rkw)
        res[name] = (o, l, *_grads(o, xs, do.to(dt)))
    _check_all((out, lse, *grads), res["64"], res["low"], ("out", "lse", "dq", "dk", "dv"))
    return out, lse, grads


# (B, Sq, Sk, Hq, Hk, D, options): odd lengths, Sq != Sk, GQA 1 / 4, D 8..256
DENSE_CASES = [
    (2, 17, 63, 4, 1, 48, dict()),
    (1, 63, 17, 2, 2, 96, dict(causal=True)),                       # Sq > Sk: first rows see nothing
    (1, 33, 33, 4, 1, 48, dict(window_size=(7, 3))),
    (2, 17, 40, 2, 1, 48, dict(causal=True, window_size=(5, -1), softcap=1.5)),
    (1, 1, 63, 2, 2, 8, dict(softmax_scale=0.3)),                    # one query
    (1, 40, 1, 2, 1, 16, dict(causal=True)),                         # one key, rows before it masked
    (1, 9, 20, 1, 1, 256, dict(window_size=(-1, 2))),
    (1, 30, 30, 2, 2, 48, dict(window_size=(0, 0))),                 # the diagonal only
    (1, 20, 50, 2, 2, 32, dict(window_size=(3, -1))),                # rows see a short band far right
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: f"B{c[0]}-Sq{c[1]}-Sk{c[2]}-H{c[3]}/{c[4]}-D{c[5]}-{c[6]}")
def test_dense_matches_reference(case, poisoned):
    b, sq, sk, hq, hk, d, kw = case
    q, k, v = _inputs([(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)])
    _compare_dense(q, k, v, **kw)


@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes(H)", "slopes(B,H)"])
def test_alibi_with_softcap(per_batch, poisoned):
    b, sq, sk, hq, hk, d = 2, 17, 34, 4, 2, 48
    q, k, v = _inputs([(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)])
    slopes = torch.rand((b, hq) if per_batch else (hq,)) * 0.5
    _compare_dense(q, k, v, alibi_slopes=slopes, softcap=5.0, causal=per_batch)


def test_fully_masked_rows_zero_output_inf_lse_zero_grad(poisoned):
    # Sq > Sk with causal: query i < Sq - Sk sees no key
    q, k, v = _inputs([(1, 20, 2, 16), (1, 5, 2, 16), (1, 5, 2, 16)])
    out, lse, (dq, dk, dv) = _compare_dense(q, k, v, causal=True)
    assert torch.equal(out[:, :15], torch.zeros_like(out[:, :15]))
    assert torch.isinf(lse[:, :, :15]).all() and (lse[:, :, :15] > 0).all()
    assert torch.equal(dq[:, :15], torch.zeros_like(dq[:, :15]))
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("pipe", [False, True], ids=["loop", "pipelined-loop"])
def test_forward_loop_variants(pipe, monkeypatch, poisoned):
    # the two forward loops (plain FA2 order / software-pipelined by one key block) the GPU
    # autotuner chooses between; every key-block range non-empty: window left edge, unmasked
    # middle, diagonal; Sq != Sk, GQA, odd lengths, dropout
    from delta_attn.ops.flash import launch
    monkeypatch.setitem(launch._INTERP_FWD, "PIPE", pipe)
    q, k, v = _inputs([(1, 45, 2, 16), (1, 71, 1, 16), (1, 71, 1, 16)])
    _compare_dense(q, k, v, causal=True, window_size=(37, -1))
    from delta_attn.ops.flash.launch import dropout_keep_mask
    mask = dropout_keep_mask(_seed_of_next_call(7), 1, 2, 45, 71, 0.25)
    torch.manual_seed(7)
    _compare_dense(q, k, v, dropout_p=0.25, softcap=4.0, dropout_mask=mask)


def _varlen_ref(q, k, v, cu_q, cu_k, layout, do, masks=None, **kw):
    res = {}
    for name, dt, up in (("64", torch.float64, True), ("low", q.dtype, False)):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, l = reference.attention_varlen(*xs, cu_q, cu_k, layout=layout, dropout_masks=masks, upcast=up, **kw)
        res[name] = (o, l, *_grads(o, xs, do.to(dt)))
    return res


@pytest.mark.parametrize("layout", ["thd", "htd"])
def test_varlen_matches_reference(layout, poisoned):
    # zero-length q and k sequences, a length-1 sequence, Sq != Sk per sequence, GQA 4
    lq, lk = [0, 1, 17, 5, 40], [3, 0, 25, 5, 33]
    hq, hk, d = 4, 1, 48
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    tq, tk = sum(lq), sum(lk)
    shp = (lambda t, h: (t, h, d)) if layout == "thd" else (lambda t, h: (h, t, d))
    q, k, v = _inputs([shp(tq, hq), shp(tk, hk), shp(tk, hk)])
    slopes = torch.rand(len(lq), hq)
    kw = dict(causal=True, softcap=3.0, alibi_slopes=slopes)
    out, lse, _ = da.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq) + 3, max(lk), return_attn_probs=True,
                                            layout=layout, backend="triton", **kw)
    assert lse.shape == (hq, tq)
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    res = _varlen_ref(q, k, v, cu_q, cu_k, layout, do, **kw)
    _check_all((out, lse, *grads), res["64"], res["low"], ("out", "lse", "dq", "dk", "dv"))


def test_varlen_window_noncausal_equals_per_sequence_loop(poisoned):
    lq, lk = [7, 19, 1], [12, 19, 9]
    cu_q = torch.tensor([0, 7, 26, 27], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 31, 40], dtype=torch.int32)
    q, k, v = _inputs([(27, 2, 32), (40, 2, 32), (40, 2, 32)])
    kw = dict(window_size=(4, 6))
    out = da.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 19, backend="triton", **kw)
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    res = _varlen_ref(q, k, v, cu_q, cu_k, "thd", do, **kw)
    _check_all((out, *grads), (res["64"][0], *res["64"][2:]), (res["low"][0], *res["low"][2:]),
               ("out", "dq", "dk", "dv"))
    # structural identity: each sequence alone through the dense path gives the same numbers
    for i in range(3):
        a, b, c, e = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        o_i = da.flash_attn_func(q[None, a:b].detach(), k[None, c:e].detach(), v[None, c:e].detach(),
                                 backend="triton", **kw)
        torch.testing.assert_close(o_i[0], out[a:b].detach(), atol=2e-3, rtol=0)


def _seed_of_next_call(seed_value):
    from delta_attn.ops.flash.launch import draw_dropout_seed
    torch.manual_seed(seed_value)
    return draw_dropout_seed("cpu")


def test_dropout_matches_reference_with_regenerated_mask(poisoned):
    from delta_attn.ops.flash.launch import dropout_keep_mask
    b, sq, sk, hq, hk, d, p = 2, 17, 40, 4, 1, 32, 0.3
    q, k, v = _inputs([(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)])
    mask = dropout_keep_mask(_seed_of_next_call(11), b, hq, sq, sk, p)
    kept = mask.float().mean().item()
    assert abs(kept - (1 - p)) < 0.03, kept
    torch.manual_seed(11)
    out, _, grads = _compare_dense(q, k, v, dropout_p=p, causal=True, dropout_mask=mask)
    # reproducible under torch.manual_seed; another seed gives another mask
    torch.manual_seed(11)
    again = da.flash_attn_func(q, k, v, dropout_p=p, causal=True, backend="triton")
    assert torch.equal(again, out)
    torch.manual_seed(12)
    other = da.flash_attn_func(q, k, v, dropout_p=p, causal=True, backend="triton")
    assert not torch.equal(other, out)


def test_dropout_varlen(poisoned):
    from delta_attn.ops.flash.launch import dropout_keep_mask
    lq, lk, p, hq = [5, 0, 18], [9, 4, 18], 0.2, 2
    cu_q = torch.tensor([0, 5, 5, 23], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 31], dtype=torch.int32)
    q, k, v = _inputs([(23, hq, 16), (31, hq, 16), (31, hq, 16)])
    full = dropout_keep_mask(_seed_of_next_call(5), 3, hq, 18, 18, p, rng_stride=18)
    masks = [full[i:i + 1, :, :lq[i], :lk[i]] for i in range(3)]
    torch.manual_seed(5)
    out = da.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 18, 18, dropout_p=p, backend="triton")
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    res = _varlen_ref(q, k, v, cu_q, cu_k, "thd", do, masks=masks, dropout_p=p)
    _check_all((out, *grads), (res["64"][0], *res["64"][2:]), (res["low"][0], *res["low"][2:]),
               ("out", "dq", "dk", "dv"))


def test_deterministic_gradients_bit_identical():
    q, k, v = _inputs([(1, 33, 4, 32), (1, 47, 1, 32), (1, 47, 1, 32)])
    do = torch.randn(1, 33, 4, 32).to(DT)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        out = da.flash_attn_func(q, k, v, causal=True, dropout_p=0.1, deterministic=True, backend="triton")
        runs.append(_grads(out, (q, k, v), do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_float32_input_is_refused_with_reasons():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(UnsupportedError, match="supports float16, bfloat16, got float32"):
        da.flash_attn_func(q, q, q, backend="triton")
    with pytest.raises(UnsupportedError, match="multiples of 8"):
        x = torch.randn(1, 4, 2, 12, dtype=DT)
        da.flash_attn_func(x, x, x, backend="triton")


def test_torch_compile_fullgraph_through_custom_op():
    q, k, v = _inputs([(1, 17, 2, 16), (1, 20, 1, 16), (1, 20, 1, 16)])

    def f(q, k, v):
        out, lse, _ = da.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, backend="triton")
        return out.float().square().sum() + lse.sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    loss_e = f(q, k, v)
    grads_e = torch.autograd.grad(loss_e, (q, k, v))
    torch.testing.assert_close(loss, loss_e)
    for a, b in zip(grads, grads_e):
        assert torch.equal(a, b)


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(7, 3, 16, dtype=DT)
        k = torch.empty(9, 1, 16, dtype=DT)
        cu = torch.empty(3, dtype=torch.int32)
        out, lse, seed = torch.ops.delta_attn.flash_attn_fwd(q, k, k, cu, cu, 5, 6, "thd", 0.25, -1, 0, 0.0, None, 0.0)
        assert out.shape == (7, 3, 16) and lse.shape == (3, 7) and lse.dtype == torch.float32
        dq, dk, dv = torch.ops.delta_attn.flash_attn_bwd(out, q, k, k, out, lse, seed, cu, cu, 5, 6, "thd", 0.25,
                                                         -1, 0, 0.0, None, 0.0)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_autotune_keys_bucket_sequence_lengths():
    """Issue bar: a varlen training loop must not re-tune every step. The autotune keys hold only the
    length buckets (powers of two in [64, 16384]) and flags, never a raw length."""
    from delta_attn.ops.flash import launch as ti
    for kind in ("fwd", "dkdv", "dq"):
        keys = ti._tuned.__wrapped__(kind, 128).keys
        assert {"SQ_BUCKET", "SK_BUCKET"} <= set(keys), kind
        assert not any(k.lower() in ("sq", "sk", "max_seqlen_q", "max_seqlen_k", "seqlen_q", "seqlen_k",
                                     "n_q", "n_k") for k in keys), keys
    buckets = {ti._bucket(n) for n in range(1, 20000, 7)}
    assert buckets == {64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}


# ---------------------------------------------------------------------------------------------
# the LSE is differentiable: gradients of sum(out W) + sum(lse w)
# ---------------------------------------------------------------------------------------------


def _grads_through_lse(out, lse, xs, w_out, w_lse):
    """Gradients of ``sum(out W) + sum(lse w)`` (``W`` None: lse alone). ``w`` is NaN on rows with lse = +inf:
    no key, so no gradient, and whatever reaches them must be ignored."""
    w = torch.where(torch.isinf(lse), float("nan"), w_lse.to(lse.dtype))
    outs, gos = ([lse], [w]) if w_out is None else ([out, lse], [w_out.to(out.dtype), w])
    return torch.autograd.grad(outs, xs, gos, retain_graph=True, allow_unused=True, materialize_grads=True)


# (B, Sq, Sk, Hq, Hk, D, options, lse only)
LSE_GRAD_CASES = [
    (1, 20, 7, 2, 1, 16, dict(causal=True), False),                         # first 13 rows see no key
    (2, 13, 21, 2, 2, 16, dict(alibi_slopes=(2, 2), softcap=2.0), False),    # ALiBi, keys on both sides
    (1, 17, 9, 4, 2, 32, dict(window_size=(2, 1), alibi_slopes=(4,)), False),  # rows 0..6 see no key
    (1, 11, 11, 2, 1, 16, dict(window_size=(3, -1), softmax_scale=0.4), True),  # lse alone reaches the loss
    (1, 15, 19, 2, 2, 16, dict(dropout_p=0.25, causal=True), False),        # lse is that before dropout
]


@pytest.mark.parametrize("case", LSE_GRAD_CASES, ids=lambda c: f"Sq{c[1]}-Sk{c[2]}-{c[6]}-lse_only={c[7]}")
def test_lse_gradient_dense(case, poisoned):
    from delta_attn.ops.flash.launch import dropout_keep_mask
    b, sq, sk, hq, hk, d, kw, lse_only = case
    kw = dict(kw)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = torch.rand(kw["alibi_slopes"]) * 0.5
    q, k, v = _inputs([(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)])
    mask = None
    if kw.get("dropout_p", 0) > 0:
        mask = dropout_keep_mask(_seed_of_next_call(3), b, hq, sq, sk, kw["dropout_p"])
        torch.manual_seed(3)
    out, lse, _ = da.flash_attn_func(q, k, v, return_attn_probs=True, backend="triton", **kw)
    assert lse.requires_grad
    w_out = None if lse_only else torch.randn(out.shape, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, dtype=torch.float64)
    got = _grads_through_lse(out, lse, (q, k, v), w_out, w_lse)
    assert all(torch.isfinite(g).all() for g in got)
    res = {}
    for name, dt, up in (("64", torch.float64, True), ("low", q.dtype, False)):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, l = reference.attention(*xs, dropout_mask=mask, upcast=up, **kw)
        res[name] = _grads_through_lse(o, l, xs, w_out, w_lse)
    _check_all(got, res["64"], res["low"], ("dq", "dk", "dv"))
    if not lse_only:
        # the lse term changes the gradient (the check above would not notice a dropped dlse otherwise)
        plain = torch.autograd.grad(out, (q, k, v), w_out.to(out.dtype))
        assert any(not torch.allclose(a.float(), b.float(), atol=1e-2) for a, b in zip(got, plain))


@pytest.mark.parametrize("layout", ["thd", "htd"])
def test_lse_gradient_varlen(layout, poisoned):
    # an empty q sequence, an empty k sequence (its rows see no key), Sq > Sk (causal: leading rows empty)
    lq, lk = [0, 3, 9, 5], [2, 0, 12, 3]
    hq, hk, d = 2, 1, 16
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    shp = (lambda t, h: (t, h, d)) if layout == "thd" else (lambda t, h: (h, t, d))
    q, k, v = _inputs([shp(sum(lq), hq), shp(sum(lk), hk), shp(sum(lk), hk)])
    kw = dict(causal=True, softcap=3.0, alibi_slopes=torch.rand(len(lq), hq) * 0.5)
    out, lse, _ = da.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True,
                                            layout=layout, backend="triton", **kw)
    assert torch.isinf(lse).any()
    w_out, w_lse = torch.randn(out.shape, dtype=torch.float64), torch.randn(lse.shape, dtype=torch.float64)
    got = _grads_through_lse(out, lse, (q, k, v), w_out, w_lse)
    res = {}
    for name, dt, up in (("64", torch.float64, True), ("low", q.dtype, False)):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, l = reference.attention_varlen(*xs, cu_q, cu_k, layout=layout, upcast=up, **kw)
        res[name] = _grads_through_lse(o, l, xs, w_out, w_lse)
    _check_all(got, res["64"], res["low"], ("dq", "dk", "dv"))
