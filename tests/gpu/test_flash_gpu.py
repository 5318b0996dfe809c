"""backend="triton" flash attention on a CUDA GPU: bf16 and fp16, sequence lengths up to 16K, every
feature, against the float64 reference with the DESIGN error rule (outputs poisoned with NaN)."""
import pytest
import torch

import delta_attn as da
from delta_attn import reference
from delta_attn.ops.flash import launch
from delta_attn.testing import assert_close

DEV = "cuda"


def _inputs(shapes, dtype):
    return [torch.randn(s, device=DEV, dtype=torch.float32).to(dtype).requires_grad_() for s in shapes]


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


def _ref(fn, xs, do, **kw):
    res = {}
    for name, dt, up in (("64", torch.float64, True), ("low", xs[0].dtype, False)):
        ys = [t.detach().to(dt).requires_grad_() for t in xs]
        o, l = fn(*ys, upcast=up, **kw)
        res[name] = (o, l, *_grads(o, ys, do.to(dt)))
        del ys, o, l
    return res


def _check(got, res, names=("out", "lse", "dq", "dk", "dv")):
    for g, r, l, n in zip(got, res["64"], res["low"], names):
        assert_close(g, r, l, kind="grad" if n.startswith("d") else "fwd", name=n)


def _dense(dtype, b, sq, sk, hq, hk, d, mask=None, **kw):
    q, k, v = _inputs([(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)], dtype)
    out, lse, _ = da.flash_attn_func(q, k, v, return_attn_probs=True, backend="triton", **kw)
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    rkw = {n: kw[n] for n in ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "dropout_p")
           if n in kw}
    res = _ref(reference.attention, (q, k, v), do, dropout_mask=mask, **rkw)
    _check((out, lse, *grads), res)
    return q, k, v, out, grads


CASES = [
    (torch.bfloat16, 2, 1025, 1025, 8, 2, 128, dict(causal=True)),
    (torch.float16, 2, 1025, 1025, 8, 2, 128, dict(causal=True)),
    (torch.bfloat16, 1, 997, 2053, 4, 1, 64, dict()),
    (torch.float16, 1, 1500, 700, 4, 4, 96, dict(causal=True)),            # Sq > Sk: empty rows
    (torch.bfloat16, 1, 2048, 2048, 4, 2, 128, dict(window_size=(256, 64))),
    (torch.float16, 1, 1000, 1000, 4, 4, 64, dict(window_size=(100, 100), softcap=20.0)),
    (torch.bfloat16, 1, 777, 1500, 2, 1, 256, dict(softcap=30.0, alibi_slopes="H")),
    (torch.float16, 2, 513, 300, 4, 4, 8, dict(alibi_slopes="BH", causal=True)),
    (torch.bfloat16, 1, 16384, 16384, 2, 1, 128, dict(causal=True)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-B{c[1]}-{c[2]}x{c[3]}-H{c[4]}/{c[5]}-D{c[6]}-"
                                                   + "-".join(sorted(c[7])))
def test_dense(case, poisoned):
    dtype, b, sq, sk, hq, hk, d, kw = case
    kw = dict(kw)
    if kw.get("alibi_slopes") == "H":
        kw["alibi_slopes"] = torch.rand(hq, device=DEV) * 0.1
    elif kw.get("alibi_slopes") == "BH":
        kw["alibi_slopes"] = torch.rand(b, hq, device=DEV) * 0.1
    _dense(dtype, b, sq, sk, hq, hk, d, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dropout(dtype, poisoned):
    from delta_attn.ops.flash.launch import draw_dropout_seed, dropout_keep_mask
    b, s, hq, hk, d, p = 1, 1031, 4, 2, 128, 0.15
    torch.manual_seed(21)
    mask = dropout_keep_mask(draw_dropout_seed(DEV), b, hq, s, s, p)
    assert abs(mask.float().mean().item() - (1 - p)) < 0.01
    q, k, v = _inputs([(b, s, hq, d), (b, s, hk, d), (b, s, hk, d)], dtype)
    kw = dict(causal=True, dropout_p=p)
    torch.manual_seed(21)
    out, lse, _ = da.flash_attn_func(q, k, v, return_attn_probs=True, backend="triton", **kw)
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    res = _ref(reference.attention, (q, k, v), do, dropout_mask=mask, causal=True, dropout_p=p)
    _check((out, lse, *grads), res)
    torch.manual_seed(22)
    assert not torch.equal(da.flash_attn_func(q, k, v, backend="triton", **kw), out)


@pytest.mark.parametrize("layout", ["thd", "htd"])
def test_varlen(layout, poisoned):
    lq = [0, 1, 1000, 4097, 333, 2048]
    lk = [5, 0, 1000, 4097, 900, 2000]
    hq, hk, d, dtype = 8, 2, 128, torch.bfloat16
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    shp = (lambda t, h: (t, h, d)) if layout == "thd" else (lambda t, h: (h, t, d))
    q, k, v = _inputs([shp(sum(lq), hq), shp(sum(lk), hk), shp(sum(lk), hk)], dtype)
    kw = dict(causal=True, alibi_slopes=torch.rand(len(lq), hq, device=DEV) * 0.05)
    out, lse, _ = da.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True,
                                            layout=layout, backend="triton", **kw)
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    res = _ref(lambda *xs, **a: reference.attention_varlen(*xs, cu_q, cu_k, layout=layout, **a), (q, k, v), do, **kw)
    _check((out, lse, *grads), res)


def test_deterministic_and_reproducible_dropout():
    q, k, v = _inputs([(2, 2048, 8, 128), (2, 2048, 2, 128), (2, 2048, 2, 128)], torch.bfloat16)
    do = torch.randn(2, 2048, 8, 128, device=DEV, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        out = da.flash_attn_func(q, k, v, causal=True, dropout_p=0.1, deterministic=True, backend="triton")
        runs.append((out, *_grads(out, (q, k, v), do)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_strided_unaligned_views_take_the_pointer_path(poisoned):
    # head dim sliced out of a wider buffer: 2-byte offset, so no TMA descriptor; strides honoured
    b, s, h, d = 2, 777, 4, 64
    buf = [torch.randn(b, s, h, d + 8, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
    q, k, v = (x[..., 1:d + 1].requires_grad_() for x in buf)
    from delta_attn.ops.flash.launch import _tma_ok
    assert not _tma_ok(k, v)
    out, lse, _ = da.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, backend="triton")
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    _check((out, lse, *grads), _ref(reference.attention, (q, k, v), do, causal=True))


def _fwd_ids(cfg):
    return "-".join(str(x) for x in cfg[:4]) + "".join(f"-{k}" for k, on in (cfg[4] if len(cfg) > 4 else {}).items()
                                                      if on)


@pytest.mark.parametrize("cfg", launch._FWD_CONFIGS[128], ids=_fwd_ids)
def test_every_d128_forward_config_varlen_window(cfg, poisoned):
    # each forward configuration the D=128 autotuner may pick (pipelined loop, TMA descriptors per
    # sequence) on a packed batch with empty / length-1 / long sequences, GQA, a sliding window
    lq, lk = [0, 1, 1500, 777, 3000], [4, 0, 1500, 1200, 2999]
    hq, hk, d = 4, 2, 128
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q, k, v = _inputs([(sum(lq), hq, d), (sum(lk), hk, d), (sum(lk), hk, d)], torch.bfloat16)
    kw = dict(window_size=(700, 300))
    with torch.no_grad():     # the launcher with this configuration, untuned
        out, lse = launch.flash_fwd(q, k, v, cu_q, cu_k, max(lq), max(lk), "thd", d ** -0.5, 700, 300,
                                         config=cfg)
        for name, dt, up in (("64", torch.float64, True), ("low", torch.bfloat16, False)):
            ys = [t.detach().to(dt) for t in (q, k, v)]
            o, l = reference.attention_varlen(*ys, cu_q, cu_k, upcast=up, **kw)
            if name == "64":
                ref64 = (o, l)
            else:
                reflow = (o, l)
    for g, r, lo, n in zip((out, lse), ref64, reflow, ("out", "lse")):
        assert_close(g, r, lo, kind="fwd", name=n)


# --- issue 15: keys past Sk in a tile while a row's visible scores are very negative -------------------------
def _aligned(shapes, dtype, shift=2.0):
    """q near -u and k near +u (u = shift per channel): every score is about -scale * shift^2 * D."""
    q = -shift + 0.3 * torch.randn(shapes[0], device=DEV)
    k = shift + 0.3 * torch.randn(shapes[1], device=DEV)
    return [t.to(dtype).requires_grad_() for t in (q, k, torch.randn(shapes[2], device=DEV))]


# (dtype, Sq, Sk, D, inputs, options): Sk = 1 or one key past a 64-key tile (Sk = 65, 129); scores near
# -45 overflow fp16 in p = exp(0 - lse) at a zero-loaded key past Sk, scores near -150 overflow fp32 (bf16)
SHORT_TILE_CASES = [
    (torch.float16, 17, 1, 64, "randn", dict(softmax_scale=-10.0)),           # the shape
    (torch.bfloat16, 17, 1, 128, "aligned", dict(softmax_scale=0.3)),
    (torch.float16, 1025, 65, 128, "aligned", dict()),
    (torch.bfloat16, 1025, 129, 128, "aligned", dict(softmax_scale=0.3, window_size=(-1, 7))),
    (torch.float16, 300, 65, 64, "aligned", dict(causal=True)),
    (torch.float16, 300, 97, 64, "aligned", dict(softmax_scale=0.3, softcap=40.0)),
    (torch.bfloat16, 300, 70, 256, "aligned", dict(softmax_scale=0.15, alibi_slopes="H")),
]


def _short_tile_ids(c):
    return f"{str(c[0])[6:]}-{c[1]}x{c[2]}-D{c[3]}-{c[4]}-" + "-".join(f"{k}={v}" for k, v in sorted(c[5].items()))


@pytest.mark.parametrize("case", SHORT_TILE_CASES, ids=_short_tile_ids)
def test_short_key_tile_very_negative_scores(case, poisoned):
    dtype, sq, sk, d, mode, kw = case
    hq, hk = 4, 2
    kw = dict(kw)
    if kw.get("alibi_slopes") == "H":
        kw["alibi_slopes"] = torch.rand(hq, device=DEV) * 0.5
    shapes = [(1, sq, hq, d), (1, sk, hk, d), (1, sk, hk, d)]
    q, k, v = _aligned(shapes, dtype) if mode == "aligned" else _inputs(shapes, dtype)
    out, lse, _ = da.flash_attn_func(q, k, v, return_attn_probs=True, backend="triton", **kw)
    assert int((lse < -12).sum()) > 0, "the case must hold rows with very negative scores"
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    for n, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{n} holds {int((~torch.isfinite(g)).sum())} non-finite values"
    rkw = {n: kw[n] for n in ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes") if n in kw}
    res = _ref(reference.attention, (q, k, v), do, **rkw)
    if sk == 1:
        # one key: p = 1 in every row, so the true dq and dk are exactly 0 (so is the fp16 reference's error);
        # ours keeps the fp32 rounding of dP - delta times |softmax_scale| and a sum of |q| or |k| (~1e-4),
        # far below a wrong p (~|softmax_scale| |dP| |k| ~ 100)
        for g, r, lo, n in zip((out, lse, *grads), res["64"], res["low"], ("out", "lse", "dq", "dk", "dv")):
            assert_close(g, r, lo, kind="grad" if n.startswith("d") else "fwd", name=n,
                         floor=1e-3 if n in ("dq", "dk") else None)
    else:
        _check((out, lse, *grads), res)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_zero_and_one_length_sequences_very_negative_scores(dtype, causal, poisoned):
    lq, lk = [0, 1, 1000, 1, 3, 129, 2], [0, 1, 1001, 1, 0, 1, 65]
    hq, hk, d = 4, 2, 128
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q, k, v = _aligned([(sum(lq), hq, d), (sum(lk), hk, d), (sum(lk), hk, d)], dtype)
    kw = dict(causal=causal, softmax_scale=0.3)          # scores near -150
    out, lse, _ = da.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), return_attn_probs=True,
                                            backend="triton", **kw)
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    for n, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{n} holds {int((~torch.isfinite(g)).sum())} non-finite values"
    a, b = int(cu_q[4]), int(cu_q[5])                     # the queries of the sequence with no key
    assert torch.equal(grads[0][a:b], torch.zeros_like(grads[0][a:b]))
    res = _ref(lambda *xs, **a_: reference.attention_varlen(*xs, cu_q, cu_k, **a_), (q, k, v), do, **kw)
    _check((out, lse, *grads), res)


@pytest.mark.parametrize("cfgs", list(zip(launch._DKDV_CONFIGS[128], launch._DQ_CONFIGS[128])),
                         ids=lambda c: "dkdv" + "-".join(map(str, c[0])) + "_dq" + "-".join(map(str, c[1])))
def test_every_d128_backward_config_short_key_tile(cfgs, poisoned):
    # each backward configuration the D=128 autotuner may pick, with one key past a 64- or 128-key tile:
    # the launchers with this configuration, untuned
    for sk in (65, 129):
        q, k, v = _aligned([(1, 200, 4, 128), (1, sk, 1, 128), (1, sk, 1, 128)], torch.float16)
        scale = 128 ** -0.5
        with torch.no_grad():
            out, lse = launch.flash_fwd(q, k, v, scale=scale)
            do = torch.randn_like(out)
            grads = launch.flash_bwd(do, q, k, v, out, lse, scale=scale, dkdv_config=cfgs[0], dq_config=cfgs[1])
        _check((out, lse, *grads), _ref(reference.attention, (q, k, v), do))
