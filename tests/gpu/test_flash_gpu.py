"""backend="triton" flash attention on a CUDA GPU: bf16 and fp16, sequence lengths up to 16K, every
feature, against the float64 reference with the DESIGN error rule (outputs poisoned with NaN)."""
import pytest
import torch

import delta_attn as da
from delta_attn import reference
from delta_attn.ops.flash import triton_impl
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
    from delta_attn.ops.flash.triton_impl import draw_dropout_seed, dropout_keep_mask
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
    from delta_attn.ops.flash.triton_impl import _tma_ok
    assert not _tma_ok(k, v)
    out, lse, _ = da.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, backend="triton")
    do = torch.randn_like(out)
    grads = _grads(out, (q, k, v), do)
    _check((out, lse, *grads), _ref(reference.attention, (q, k, v), do, causal=True))


def _fwd_ids(cfg):
    return "-".join(str(x) for x in cfg[:4]) + "".join(f"-{k}" for k, on in (cfg[4] if len(cfg) > 4 else {}).items()
                                                      if on)


@pytest.mark.parametrize("cfg", triton_impl._FWD_CONFIGS[128], ids=_fwd_ids)
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
        out, lse = triton_impl.flash_fwd(q, k, v, cu_q, cu_k, max(lq), max(lk), "thd", d ** -0.5, 700, 300,
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
