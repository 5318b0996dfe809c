"""GPU tests of backend="cudnn" for KDA (cuDNN frontend's kimi_delta_attention, sm_90 engine), bf16, K = V = 128.

Against the float64 reference with the project's error rule (delta_attn.testing): dense and varlen forward
(an empty sequence included), initial / final state, GVA, the lower_bound gate with and without dt_bias,
a custom scale, a long sequence that the engine splits into segments; the backward with q/k normalised
before the call (gradients of q, k, v, g, beta and the initial state); the refusals; torch.compile.
The whole module is skipped with the registry's reasons where the backend cannot run (no frontend, not
sm_90, no NVRTC toolchain).
"""
import pytest
import torch

import delta_attn as da
from delta_attn.backends import BACKENDS, Call, UnsupportedError
from delta_attn.ops.kda import cudnn as CK

import properties

DEV = "cuda"
DT = torch.bfloat16
D = 128


def _why_not():
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    call = Call("kda", torch.device("cuda", torch.cuda.current_device()), DT, (D, D))
    return "; ".join(BACKENDS["cudnn"].not_supported_reasons(call)) or None


_SKIP = _why_not()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=f"backend='cudnn' cannot run KDA here: {_SKIP}")


def make(B, T, H, HV, h0=False, cu=None, gate=None, normed=False, strong=False, beta_dtype=DT):
    """normed: q and k L2-normalised here (bf16), as a training caller of the cuDNN backward must."""
    q = torch.randn(B, T, H, D, device=DEV, dtype=DT)
    k = torch.randn(B, T, H, D, device=DEV, dtype=DT)
    if normed:
        q, k = CK.prenorm(q), CK.prenorm(k)
    v = torch.randn(B, T, HV, D, device=DEV, dtype=DT)
    if gate is None:
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, D, device=DEV) + 3.0)
        if strong:      # 10 % of the tokens decay every channel by e^-5: the engine's segments then start
            # from a truncated state (its walk-back stops once the bound falls below 2^-20)
            reset = torch.rand(B, T, HV, 1, device=DEV) < 0.1
            g = torch.where(reset, torch.full_like(g, -5.0), g)
    else:
        g = torch.randn(B, T, HV, D, device=DEV)
    g = g.to(DT)
    beta = torch.rand(B, T, HV, device=DEV).to(beta_dtype)
    kw = {}
    if gate is not None:
        kw.update(A_log=torch.randn(HV, device=DEV) * 0.5, lower_bound=-5.0)
        if gate == "dt_bias":
            kw["dt_bias"] = torch.randn(HV * D, device=DEV) * 0.5
    if h0:
        kw["initial_state"] = torch.randn(B if cu is None else len(cu) - 1, HV, D, D, device=DEV) * 0.1
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, device=DEV, dtype=torch.int32)
    return [q, k, v, g, beta], kw


def check(xs, kw, grad=False, **opts):
    """The error rule (docs/TESTING.md) against float64 (tests/properties.kda_compare), plus the dtypes and layout cuDNN must return."""
    bad, out = properties.kda_compare(xs, kw, grad, 3, backend="cudnn", **opts)
    assert not bad, "; ".join(bad)
    assert out[0].dtype == DT
    if out[1] is not None:
        assert out[1].is_contiguous()
    names = ["dq", "dk", "dv", "dg", "dbeta"] + (["d_initial_state"] if "initial_state" in kw else [])
    assert len(out[2]) == (len(names) if grad else 0)
    for name, a, x in zip(names, out[2], xs + [kw.get("initial_state")]):
        assert a.dtype == x.dtype, name
    return out


# ------------------------------------------------------------------------------------- forward

def test_forward_dense_state_l2norm_in_kernel():
    xs, kw = make(2, 300, 2, 2, h0=True)
    check(xs, kw, use_qk_l2norm=True, output_final_state=True)


def test_forward_varlen():
    xs, kw = make(1, 463, 2, 2, h0=True, cu=[0, 17, 200, 463])
    check(xs, kw, use_qk_l2norm=True, output_final_state=True)


def test_forward_varlen_with_an_empty_sequence():
    xs, kw = make(1, 463, 2, 2, h0=True, cu=[0, 17, 17, 200, 463])
    _, s, _ = check(xs, kw, use_qk_l2norm=True, output_final_state=True)
    torch.testing.assert_close(s[1], kw["initial_state"][1], rtol=0, atol=0)


@pytest.mark.parametrize("H,HV", [(2, 4), (1, 4)])
def test_forward_gva(H, HV):
    xs, kw = make(2, 200, H, HV, h0=True)
    check(xs, kw, use_qk_l2norm=True, output_final_state=True)


@pytest.mark.parametrize("gate", ["dt_bias", "no_dt_bias"])
def test_forward_lower_bound_gate(gate):
    xs, kw = make(2, 150, 2, 2, gate=gate, h0=True)
    check(xs, kw, use_qk_l2norm=True, output_final_state=True)


def test_forward_custom_scale_and_no_state():
    xs, kw = make(2, 97, 2, 2)
    o, s, _ = check(xs, kw, use_qk_l2norm=True, scale=0.05)
    assert s is None


def test_forward_long_sequence_split_into_segments():
    # one sequence of 2048 tokens on 2 heads: the engine runs it as 128 one-chunk segments in parallel; strong
    # decays make them start from a truncated (attenuated below 2^-20) state
    xs, kw = make(1, 2048, 2, 2, h0=True, strong=True)
    check(xs, kw, use_qk_l2norm=True, output_final_state=True)


# ------------------------------------------------------------------------------------- backward

def test_backward_dense_prenormed():
    xs, kw = make(2, 200, 2, 2, h0=True, normed=True)
    check(xs, kw, grad=True, output_final_state=True)


def test_backward_float32_beta():
    xs, kw = make(2, 130, 2, 2, h0=True, normed=True, beta_dtype=torch.float32)
    check(xs, kw, grad=True, output_final_state=True)


def test_backward_varlen():
    xs, kw = make(1, 300, 2, 2, h0=True, cu=[0, 50, 173, 300], normed=True)
    check(xs, kw, grad=True, output_final_state=True)


def test_backward_varlen_with_an_empty_sequence():
    xs, kw = make(1, 300, 2, 2, h0=True, cu=[0, 50, 50, 173, 300], normed=True)
    check(xs, kw, grad=True, output_final_state=True)


def test_backward_no_state_custom_scale():
    # the backward kernel bakes in 1/sqrt(128): the adapter runs at that scale and rescales o
    xs, kw = make(2, 111, 2, 2, normed=True)
    check(xs, kw, grad=True, scale=0.05)


def test_auto_training_on_dense_sequences_follows_the_rule():
    """auto's kda rule on this GPU: a dense bf16 training call cuDNN can run goes to cuDNN where Triton's training
    would run its Triton kernels, to Triton where it runs its sm_90 Gluon ones (measured faster); either way it
    passes the error rule; the same call with a decay below cuDNN's range goes to Triton (one host read of g's
    range)."""
    from delta_attn.ops import _gluon
    xs, kw = make(2, 200, 2, 2, h0=True, normed=True)
    ex = da.explain(da.kda, *_leafs(xs), output_final_state=True, **kw)
    assert ex.chosen == ("triton" if _gluon.kernels_release(xs[0].device) else "cudnn"), str(ex)
    bad, _ = properties.kda_compare(xs, kw, True, 3, backend="auto", output_final_state=True)
    assert not bad, "; ".join(bad)
    strong = [x.detach().clone() for x in xs]
    strong[3][0, 0, 0, 0] = -8.0
    assert da.explain(da.kda, *_leafs(strong), output_final_state=True, **kw).chosen == "triton"


# ------------------------------------------------------------------------------------- refusals

def _leafs(xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def test_unsupported_calls_raise_with_the_named_reason():
    xs, kw = make(1, 32, 2, 2)
    with pytest.raises(UnsupportedError, match=r"pre-normalised \(use_qk_l2norm=False\)"):
        da.kda(*_leafs(xs), use_qk_l2norm=True, backend="cudnn")
    with pytest.raises(UnsupportedError, match="supports bfloat16, got float16"):
        da.kda(*[x.half() for x in xs], backend="cudnn")
    small = [x[..., :64].contiguous() for x in xs[:4]] + [xs[4]]
    with pytest.raises(UnsupportedError, match="K = V = 128, got K = 64, V = 64"):
        da.kda(*small, backend="cudnn")
    xg, kg = make(1, 32, 2, 2, gate="dt_bias")
    kg.pop("lower_bound")
    with pytest.raises(UnsupportedError, match="softplus"):
        da.kda(*xg, **kg, backend="cudnn")
    xg, kg = make(1, 32, 2, 2, gate="dt_bias")
    with pytest.raises(UnsupportedError, match="log decay g only"):
        da.kda(*_leafs(xg), **kg, backend="cudnn")
    xv, kv = make(1, 32, 1, 2)
    with pytest.raises(UnsupportedError, match="no GVA"):
        da.kda(*_leafs(xv), **kv, backend="cudnn")
    # ... and the same calls without gradients run
    for args, extra in ((xs, dict(use_qk_l2norm=True)), (xv, dict(kv, use_qk_l2norm=True))):
        o, _ = da.kda(*args, **extra, backend="cudnn")
        assert torch.isfinite(o.float()).all()


# ------------------------------------------------------------------------------------- torch.compile

def test_compile_forward_fullgraph():
    xs, kw = make(2, 160, 2, 2, h0=True)

    def f(q, k, v, g, beta, h0):
        return da.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                      backend="cudnn")

    torch._dynamo.reset()
    with torch.no_grad():
        oc, sc = torch.compile(f, fullgraph=True)(*xs, kw["initial_state"])
        oe, se = f(*xs, kw["initial_state"])
    torch.testing.assert_close(oc, oe, rtol=0, atol=0)
    torch.testing.assert_close(sc, se, rtol=0, atol=0)


def test_compile_backward_fullgraph():
    xs, kw = make(2, 160, 2, 2, h0=True, normed=True)
    h0 = kw["initial_state"]

    def f(q, k, v, g, beta, h0):
        o, s = da.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="cudnn")
        return o.float().square().sum() + s.sum()

    torch._dynamo.reset()
    lc = _leafs(xs + [h0])
    yc = torch.compile(f, fullgraph=True)(*lc)
    gc = torch.autograd.grad(yc, lc)
    le = _leafs(xs + [h0])
    ye = f(*le)
    ge = torch.autograd.grad(ye, le)
    torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-3)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
