"""GPU tests of backend="sdpa" (FlashAttention-2 fp16 / bf16, memory-efficient fp32) against the float64
reference: the cases issue 15 found wrong and the seeded configurations of tests/attention_cases.py (the CPU
suite's tests/ops/test_backend_capabilities.py).

Rows that see no key (causal with Sq > Sk, Sk = 0, zero-length varlen sequences) must give zeros,
lse = +inf and zero dq; negative and zero softmax scales and the window (0, -1) must match the
reference; every other backend computes the same configurations or declares them unsupported.
"""
import pytest
import torch

import delta_attn as da
from delta_attn import reference
from delta_attn.testing import check, poison_outputs

import attention_cases as caps

CUDA = "cuda"


def _compare_dense(dtype, b, sq, sk, hq, hk, d, **kw):
    torch.manual_seed(0)
    q = torch.randn(b, sq, hq, d, device=CUDA, dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=CUDA, dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=CUDA, dtype=dtype, requires_grad=True)
    with poison_outputs():
        out, lse, _ = da.flash_attn_func(q, k, v, return_attn_probs=True, backend="sdpa", **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
    res = {}
    for name, dt, up in (("64", torch.float64, True), ("low", dtype, False)):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, l = reference.attention(*xs, upcast=up, **kw)
        res[name] = (o, l, *torch.autograd.grad(o, xs, dout.to(dt), allow_unused=True))
    verdicts = []
    for i, (name, kind) in enumerate((("out", "fwd"), ("lse", "fwd"), ("dq", "grad"), ("dk", "grad"), ("dv", "grad"))):
        got = (out, lse, *grads)[i]
        want64, wantlo = res["64"][i], res["low"][i]
        if got is None or want64 is None:
            like = (q, k, v)[i - 2]
            got, want64, wantlo = (torch.zeros_like(like) if t is None else t for t in (got, want64, wantlo))
        verdicts.append(check(got, want64, wantlo, kind=kind, name=name))
    bad = [x.message for x in verdicts if not x.ok]
    assert not bad, "; ".join(bad)
    return out, lse, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_sq_gt_sk_rows_without_keys_are_zero(dtype):
    out, lse, (dq, dk, dv) = _compare_dense(dtype, 2, 97, 63, 8, 2, 64, causal=True)
    assert torch.equal(out[:, :34], torch.zeros_like(out[:, :34]))
    assert torch.isinf(lse[:, :, :34]).all() and (lse[:, :, :34] > 0).all()
    assert torch.equal(dq[:, :34], torch.zeros_like(dq[:, :34]))


@pytest.mark.parametrize("kw", [dict(causal=True, softmax_scale=-0.5), dict(softmax_scale=-1.3),
                                dict(window_size=(16, 8), softmax_scale=-0.2), dict(causal=True, softmax_scale=0.0),
                                dict(softmax_scale=-4.0)],
                         ids=["causal-neg", "neg", "window-neg", "causal-zero", "neg-large"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_negative_and_zero_scales(dtype, kw):
    if dtype == torch.float32 and "window_size" in kw:
        pytest.skip("float32 runs the memory-efficient kernel, which declares no window")
    _compare_dense(dtype, 1, 130, 130, 4, 4, 64, **kw)


@pytest.mark.parametrize("sq, sk", [(97, 257), (257, 257), (257, 97), (1, 300)])
def test_window_zero_left_unbounded_right(sq, sk):
    _compare_dense(torch.bfloat16, 2, sq, sk, 4, 2, 128, window_size=(0, -1))


def test_no_keys_at_all():
    for dtype in (torch.bfloat16, torch.float32):
        out, lse, _ = _compare_dense(dtype, 2, 33, 0, 4, 4, 64)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()


@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(window_size=(0, -1)),
                                dict(causal=True, softmax_scale=-0.7)], ids=["causal", "full", "w0-1", "causal-neg"])
@pytest.mark.parametrize("layout", ["thd", "htd"])
def test_varlen_with_empty_sequences(layout, kw):
    lq, lk = (0, 70, 129, 33, 1, 64), (40, 0, 97, 33, 17, 0)
    case = caps.Case(0, "bf16", 1, max(lq), max(lk), 8, 2, 64, kw.get("causal", False), kw.get("window_size", (-1, -1)),
                     kw.get("softmax_scale"), lq, lk, layout, True)
    assert caps.run_case(case, "sdpa", CUDA) == "ran"


# the seeded configurations of the CPU suite, drawn for the GPU (longer sequences, head dims 36..128)
SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
def test_sdpa_matches_reference_or_declares(seed):
    caps.run_case(caps.draw(seed, "gpu"), "sdpa", CUDA)


@pytest.mark.parametrize("backend", ["torch", "triton", "cudnn"])
@pytest.mark.parametrize("seed", range(24))
def test_other_backends_match_reference_or_declare(seed, backend):
    caps.run_case(caps.draw(seed, "gpu"), backend, CUDA)
