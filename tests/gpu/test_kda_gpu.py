"""KDA on the Triton backend on a CUDA GPU, bf16, up to T = 32K (marked `gpu`)."""
import pytest
import torch

import delta_attn as da
from delta_attn import reference as ref
from delta_attn.testing import assert_close, poison_outputs

DEV = "cuda"


def make(B, T, H, HV, K, V, dtype=torch.bfloat16, decay=None, gate=None, h0=False, cu=None):
    q = torch.randn(B, T, H, K, device=DEV, dtype=dtype)
    k = torch.randn(B, T, H, K, device=DEV, dtype=dtype)
    v = torch.randn(B, T, HV, V, device=DEV, dtype=dtype)
    if gate is None:
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, device=DEV) + 3.0)
        if decay is not None:
            g = torch.where(torch.rand_like(g) < 0.1, torch.full_like(g, decay), g)
    else:
        g = torch.randn(B, T, HV, K, device=DEV)
    g = g.to(dtype)
    beta = torch.rand(B, T, HV, device=DEV, dtype=dtype)
    kw = {}
    if gate is not None:
        kw.update(A_log=torch.randn(HV, device=DEV) * 0.5, dt_bias=torch.randn(HV * K, device=DEV) * 0.5)
        if gate == "lower_bound":
            kw["lower_bound"] = -5.0
    if h0:
        kw["initial_state"] = torch.randn(B if cu is None else len(cu) - 1, HV, K, V, device=DEV) * 0.3
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, device=DEV, dtype=torch.int32)
    return [q, k, v, g, beta], kw


def _run(backend, xs, kw, grad, **opts):
    names = [n for n in ("initial_state", "A_log", "dt_bias") if n in kw]
    if backend == "ref64":
        xs = [x.double() for x in xs]
        kw = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in kw.items()}
    if grad:
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        kw = {n: (t.detach().clone().requires_grad_(True) if n in names else t) for n, t in kw.items()}
    if backend.startswith("ref"):
        o, s = ref.kda(*xs, **kw, upcast=backend == "ref64", **opts)
    else:
        with poison_outputs():
            o, s = da.kda(*xs, **kw, backend="triton", **opts)
    if not grad:
        return o, s, []
    gen = torch.Generator(device=DEV).manual_seed(3)
    loss = (o * torch.randn(o.shape, device=DEV, generator=gen).to(o.dtype)).sum()
    if s is not None:
        loss = loss + (s * torch.randn(s.shape, device=DEV, generator=gen).to(s.dtype)).sum()
    leaves = xs + [kw[n] for n in names]
    with poison_outputs():
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return o, s, [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def check(xs, kw, grad=False, **opts):
    out, r64, low = (_run(b, xs, kw, grad, **opts) for b in ("triton", "ref64", "ref_low"))
    assert_close(out[0], r64[0], low[0], name="o")
    if out[1] is not None:
        assert_close(out[1], r64[1], low[1], name="final_state")
    names = ["dq", "dk", "dv", "dg", "dbeta"] + ["d_" + n for n in ("initial_state", "A_log", "dt_bias") if n in kw]
    for name, a, b, c in zip(names, out[2], r64[2], low[2]):
        assert_close(a, b, c, kind="grad", name=name)
    return out


@pytest.mark.parametrize("T", [32768])
def test_forward_long_bf16(T):
    xs, kw = make(1, T, 1, 2, 128, 128)
    check(xs, kw, use_qk_l2norm=True, output_final_state=True)


@pytest.fixture
def train16(monkeypatch):
    """The 16-token training path (the default training chunk is 64: test_gradients64_bf16)."""
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "train_chunk", 16)


@pytest.mark.parametrize("gate,decay", [(None, None), ("softplus", None), ("lower_bound", None), (None, -1e4)])
def test_gradients_bf16(gate, decay, train16):
    xs, kw = make(2, 777, 2, 4, 128, 128, gate=gate, decay=decay, h0=True)
    out = check(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    assert all(torch.isfinite(t).all() for t in [out[0], out[1]] + out[2])


def test_varlen_gradients_bf16(train16):
    cu = [0, 100, 100, 1133, 1134, 2000]
    xs, kw = make(1, 2000, 2, 2, 64, 128, h0=True, cu=cu)
    check(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)


def test_prefill_then_decode_bf16():
    xs, _ = make(4, 300, 2, 4, 128, 128, decay=-50.0)
    o_all, _ = da.kda(*xs, use_qk_l2norm=True, backend="triton")
    _, s = da.kda(*[x[:, :257] for x in xs], output_final_state=True, use_qk_l2norm=True, backend="triton")
    pool = torch.zeros(9, 4, 128, 128, device=DEV)
    idx = torch.tensor([8, 1, 4, 2], device=DEV, dtype=torch.int32)
    pool[idx.long()] = s
    outs = []
    for t in range(257, 300, 7):       # 7 new tokens per call (fewer at the end)
        outs.append(da.kda_step(*[x[:, t:t + 7] for x in xs], pool, state_indices=idx, use_qk_l2norm=True,
                                backend="triton"))
    o_dec = torch.cat(outs, 1)
    err = (o_dec.float() - o_all[:, 257:].float()).abs().max().item()
    scale = o_all[:, 257:].float().abs().max().item()
    assert err <= 2e-2 * max(1.0, scale), (err, scale)


@pytest.mark.parametrize("T,gate,decay,cu", [
    (32768, None, None, None),
    (777, "lower_bound", None, None),
    (777, "softplus", -1e4, None),
    (777, None, float("-inf"), None),
    (2000, None, -50.0, [0, 100, 100, 1133, 1134, 2000]),
])
def test_forward64_bf16(monkeypatch, T, gate, decay, cu):
    """The opt-in forward-only 64-token path (CONFIG["fwd_chunk"] = 64) in bf16 (tf32 products)."""
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "fwd_chunk", 64)
    B, HV = (1, 2) if T > 4096 or cu is not None else (2, 4)
    xs, kw = make(B, T, HV // 2 if cu is None else 2, HV, 128, 128, gate=gate, decay=decay, h0=True, cu=cu)
    out = check(xs, kw, use_qk_l2norm=True, output_final_state=True)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("gate,decay,cu", [
    (None, None, None),
    ("lower_bound", None, None),
    ("softplus", None, None),
    (None, float("-inf"), None),
    (None, -50.0, [0, 100, 100, 1133, 1134, 2000]),
])
def test_gradients64_bf16(monkeypatch, gate, decay, cu):
    """The 64-token training path (CONFIG["train_chunk"] = 64, the default) in bf16: every gradient."""
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "train_chunk", 64)
    B, T, H, HV = (1, 2000, 2, 2) if cu is not None else (2, 777, 2, 4)
    xs, kw = make(B, T, H, HV, 128, 128, gate=gate, decay=decay, h0=True, cu=cu)
    out = check(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    assert all(torch.isfinite(t).all() for t in [out[0], out[1]] + out[2])


@pytest.mark.parametrize("variant,chunk", [("lean", 16), ("lean_dots", 16), ("lean_dots", 32)])
@pytest.mark.parametrize("T,gate,decay,cu", [
    (32768, None, None, None),
    (777, "softplus", -1e4, None),
    (777, None, float("-inf"), None),
    (2000, "lower_bound", -50.0, [0, 100, 100, 1133, 1134, 2000]),
])
def test_forward_variant_bf16(monkeypatch, variant, chunk, T, gate, decay, cu):
    """The opt-in forward prep variants (CONFIG["fwd_variant"], lean_chunk 16 / 32) in bf16 (tf32
    products, tf32x3 UT inverse for lean_dots), strong decays on the exact launch."""
    from delta_attn.ops.kda import triton_impl
    if T > 4096 and variant != "lean_dots":
        pytest.skip("one long variant run is enough")
    monkeypatch.setitem(triton_impl.CONFIG, "fwd_chunk", 16)
    monkeypatch.setitem(triton_impl.CONFIG, "fwd_variant", variant)
    monkeypatch.setitem(triton_impl.CONFIG, "lean_chunk", chunk)
    B, HV = (1, 2) if T > 4096 or cu is not None else (2, 4)
    xs, kw = make(B, T, HV // 2 if cu is None else 2, HV, 128, 128, gate=gate, decay=decay, h0=True, cu=cu)
    out = check(xs, kw, use_qk_l2norm=True, output_final_state=True)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()
