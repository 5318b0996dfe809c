"""cu_seqlens may be int64 or a strided view: the shared validation (``_checks.cu_seqlens`` /
``cu_seqlens_pair``) checks its values, then hands every backend one contiguous int32 tensor.

Each op is run three ways (int32 contiguous, int64, a strided int32 view) and must give bit-identical
outputs, final states and gradients, on backend="torch" and on backend="triton" (the Triton
interpreter on CPU, as in the other kernel tests).
"""
import pytest
import torch

import delta_attn as da
from delta_attn import _checks
from delta_attn.backends import triton_interpreter_on

LENGTHS = [5, 0, 17, 1, 9]
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_interpreter_on() and not torch.cuda.is_available(), reason="needs the Triton interpreter or a GPU"))]


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _forms(cu32):
    """The same cumulative lengths as int32, int64 and a strided (stride 2) int32 view."""
    wide = torch.stack([cu32, torch.full_like(cu32, -7)], 1)      # (N + 1, 2): column 0 is cu
    strided = wide[:, 0]
    assert strided.stride() == (2,) and not strided.is_contiguous()
    return {"int32": cu32, "int64": cu32.to(torch.int64), "strided": strided}


def _run_all(fn, leaves):
    """fn(xs, form) -> tuple of outputs; returns {form: (outputs..., grads...)}, grads of the sum of outputs[0]."""
    results = {}
    for name in ("int32", "int64", "strided"):
        xs = [t.detach().clone().requires_grad_() for t in leaves]
        outs = fn(xs, name)
        grads = torch.autograd.grad(outs[0], xs, torch.ones_like(outs[0]))
        results[name] = (*(o.detach() for o in outs if o is not None), *grads)
    return results


def _assert_identical(results):
    base = results["int32"]
    for name, got in results.items():
        for i, (a, b) in enumerate(zip(got, base)):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, i)
            assert torch.equal(a, b), f"{name}: output {i} differs from the int32 run"


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_varlen(backend):
    lk = [3, 4, 17, 6, 9]
    cu_q, cu_k = _cu(LENGTHS), _cu(lk)
    dt = torch.float16 if backend == "triton" else torch.float32
    q = torch.randn(sum(LENGTHS), 4, 16).to(dt)
    k, v = torch.randn(2, sum(lk), 2, 16).to(dt).unbind(0)

    def run(xs, form):
        out, lse, _ = da.flash_attn_varlen_func(*xs, _forms(cu_q)[form], _forms(cu_k)[form], max(LENGTHS), max(lk),
                                                causal=True, return_attn_probs=True, backend=backend)
        return out, lse

    _assert_identical(_run_all(run, (q, k, v)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kda(backend):
    t, h, hv, kd, vd = sum(LENGTHS), 1, 2, 16, 16
    q, k = torch.randn(2, 1, t, h, kd).unbind(0)
    v = torch.randn(1, t, hv, vd)
    g = -torch.rand(1, t, hv, kd)
    beta = torch.rand(1, t, hv)
    s0 = torch.randn(len(LENGTHS), hv, kd, vd)

    def run(xs, form):
        return da.kda(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=_forms(_cu(LENGTHS))[form], use_qk_l2norm=True,
                      backend=backend)

    _assert_identical(_run_all(run, (q, k, v, g, beta, s0)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_diag(backend):
    t, h, d = sum(LENGTHS), 2, 16
    q, k, v = torch.randn(3, 1, t, h, d).unbind(0)
    g = -torch.rand(1, t, h, d)
    s0 = torch.randn(len(LENGTHS), h, d)

    def run(xs, form):
        return da.gated_diag_attn(*xs[:4], initial_state=xs[4], output_final_state=True, cu_seqlens=_forms(_cu(LENGTHS))[form],
                                  backend=backend)

    _assert_identical(_run_all(run, (q, k, v, g, s0)))


def _validated_cu():
    """The cu_seqlens each op's validation hands the backends, for an int64 strided input."""
    from delta_attn.ops.diag.api import validate as validate_diag
    from delta_attn.ops.flash.api import validate_varlen
    from delta_attn.ops.kda.api import validate as validate_kda
    cu = torch.stack([_cu(LENGTHS).to(torch.int64)] * 2, 1)[:, 1]
    t = sum(LENGTHS)
    x = torch.randn(1, t, 2, 16)
    g = -x.abs()                     # a log decay (<= 0)
    qkv = torch.randn(t, 2, 16)
    a = validate_varlen(qkv, qkv, qkv, cu, cu, max(LENGTHS), max(LENGTHS))
    return {"cu_seqlens_q": a.varlen.cu_seqlens_q, "cu_seqlens_k": a.varlen.cu_seqlens_k,
            "kda": validate_kda(x, x, x, g, x[..., 0], cu_seqlens=cu).cu_seqlens,
            "diag": validate_diag(x, x, x, g, cu_seqlens=cu).cu_seqlens}, a


@pytest.mark.parametrize("skip_value_checks", ["0", "1"])
def test_backends_receive_contiguous_int32(monkeypatch, skip_value_checks):
    monkeypatch.setenv("DELTA_ATTN_SKIP_VALUE_CHECKS", skip_value_checks)
    got, a = _validated_cu()
    for name, cu in got.items():
        assert cu.dtype == torch.int32 and cu.is_contiguous(), name
        assert cu.tolist() == _cu(LENGTHS).tolist(), name
    # one tensor passed for both q and k stays one tensor (cuDNN reads that as equal lengths)
    assert a.varlen.cu_seqlens_q is a.varlen.cu_seqlens_k


def test_contiguous_int32_is_not_copied():
    cu = _cu(LENGTHS)
    out, n = _checks.cu_seqlens("cu_seqlens", cu, sum(LENGTHS), cu.device)
    assert out is cu and n == len(LENGTHS)


def test_int64_beyond_int32_is_a_named_error():
    big = torch.tensor([0, 2 ** 31, 5])
    x = torch.randn(1, 5, 2, 16)
    with pytest.raises(ValueError, match=r"cu_seqlens values must fit int32 .*got 2147483648"):
        da.kda(x, x, x, -x.abs(), x[..., 0].sigmoid(), cu_seqlens=big, backend="torch")
    with pytest.raises(ValueError, match=r"cu_seqlens values must fit int32"):
        da.gated_diag_attn(x, x, x, -x.abs(), cu_seqlens=big, backend="torch")
    y = torch.randn(5, 2, 16)
    ok = torch.tensor([0, 5])
    with pytest.raises(ValueError, match=r"cu_seqlens_k values must fit int32"):
        da.flash_attn_varlen_func(y, y, y, ok, torch.tensor([0, -2 ** 31 - 1]), 5, 5, backend="torch")


def test_flash_varlen_mixed_int32_and_int64():
    lk = [3, 4, 17, 6, 9]
    cu_q, cu_k = _cu(LENGTHS), _cu(lk)
    q = torch.randn(sum(LENGTHS), 4, 16)
    k, v = torch.randn(2, sum(lk), 2, 16).unbind(0)
    ref = da.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENGTHS), max(lk), backend="torch")
    for a, b in ((cu_q.long(), cu_k), (cu_q, cu_k.long())):
        assert torch.equal(da.flash_attn_varlen_func(q, k, v, a, b, max(LENGTHS), max(lk), backend="torch"), ref)
    bad_k = cu_k.long()
    bad_k[-1] -= 1                                    # the int64 values are checked like int32 ones
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] must equal the number of packed tokens"):
        da.flash_attn_varlen_func(q, k, v, cu_q, bad_k, max(LENGTHS), max(lk))
