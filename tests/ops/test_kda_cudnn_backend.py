"""CPU tests of backend="cudnn" for KDA (cuDNN frontend's kimi_delta_attention), with no GPU and no cudnn wheel.

* the capability and its reasons (device capability, packages and probes faked, as test_cudnn_backend.py);
* the adapter against a fake ``cudnn.linear_attention`` whose ``kimi_delta_attention`` implements the THD
  contract of the cuDNN docstring independently (token-packed tensors, states (N, HV, V, K), GVA by
  contiguous value-head groups, the "safe gate" with a_log [HO] and dt_bias [HO, K]) in float64, so the
  adapter's reshapes, state transposes, gate mapping, scale handling and gradient plumbing are checked
  against ``delta_attn.reference`` on CPU.
"""
import math
import sys
import types

import pytest
import torch

import delta_attn as da
from delta_attn import backends as B
from delta_attn import reference
from delta_attn.backends import Call, Capability, UnsupportedError, auto_order, explain_call
from delta_attn.ops.kda import api
from delta_attn.ops.kda import cudnn as CK
from delta_attn.ops.kda import register as KR

CUDA = torch.device("cuda", 0)


def _call(dtype=torch.bfloat16, dims=(128, 128), feats=(), grad=False, compiling=False, op="kda", seqlen=0):
    return Call(op=op, device=CUDA, dtype=dtype, head_dims=dims, features=frozenset(feats), needs_grad=grad,
                compiling=compiling, seqlen=seqlen)


def reasons(call):
    return B.BACKENDS["cudnn"].not_supported_reasons(call)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen compute capability with the frontend (and its toolchain) installed or not."""
    state = {"cc": (9, 0), "cudnn": True, "frontend": None, "toolchain": None}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)   # the value checks ask
    monkeypatch.setattr(B, "device_capability", lambda dev: state["cc"] if dev.type == "cuda" else None)
    real = B.package_available
    monkeypatch.setattr(B, "package_available", lambda m: state["cudnn"] if m == "cudnn" else real(m))
    monkeypatch.setattr(CK, "frontend_error", lambda: state["frontend"])
    monkeypatch.setattr(CK, "toolchain_error", lambda: state["toolchain"])
    return state


# ---------------------------------------------------------------------------------------------
# capability and reasons
# ---------------------------------------------------------------------------------------------

def test_declaration_is_the_sm90_engine():
    cap = B.BACKENDS["cudnn"].capabilities["kda"]
    assert cap.impl == "delta_attn.ops.kda.cudnn:kda"
    assert cap.dtypes == (torch.bfloat16,)
    assert cap.device_types == ("cuda",)
    assert cap.min_compute_capability == (9, 0)
    assert cap.requires == ("cudnn",)
    assert cap.features == frozenset({"varlen", "initial_state", "final_state", "qk_l2norm", "gate_lower_bound", "gva"})
    assert "gate_softplus" not in cap.features and "state_indices" not in cap.features
    assert cap.backward and cap.traceable
    assert "kda_step" not in B.BACKENDS["cudnn"].capabilities      # the sm_90 engine has no state-pool forward


def test_supported_calls_on_sm90(fake_gpu):
    assert reasons(_call()) == []
    assert reasons(_call(feats=CK.FEATURES)) == []
    # training: log-space gate, q/k normalised by the caller, equal heads
    assert reasons(_call(feats={"varlen", "initial_state", "final_state"}, grad=True)) == []
    assert reasons(_call(feats={"qk_l2norm", "gva", "gate_lower_bound"}, compiling=True)) == []


def test_dtype_dims_and_architecture_reasons(fake_gpu):
    for dt in (torch.float16, torch.float32):
        assert any("supports bfloat16, got" in r for r in reasons(_call(dtype=dt))), dt
    for dims in ((64, 64), (128, 64), (256, 128)):
        r = reasons(_call(dims=dims))
        assert any(f"K = V = 128, got K = {dims[0]}, V = {dims[1]}" in x for x in r), r
    fake_gpu["cc"] = (8, 0)
    assert any("compute capability >= 9.0" in r and "8.0" in r for r in reasons(_call()))
    fake_gpu["cc"] = (10, 0)
    r = reasons(_call())
    assert any("sm_90 engine only" in x and "10.0" in x for x in r), r
    fake_gpu["cc"] = (9, 0)
    assert reasons(_call()) == []


def test_package_and_toolchain_reasons(fake_gpu):
    fake_gpu["cudnn"] = False
    r = reasons(_call())
    assert any("cudnn not installed" in x and "nvidia-cudnn-frontend>=1.32" in x for x in r), r
    fake_gpu["cudnn"] = True
    fake_gpu["frontend"] = "cudnn-frontend is installed but has no usable cudnn.linear_attention.kimi_delta_attention"
    assert fake_gpu["frontend"] in reasons(_call())
    fake_gpu["frontend"] = None
    fake_gpu["toolchain"] = "needs cuda-python and the CUDA headers"
    assert fake_gpu["toolchain"] in reasons(_call())


def test_gate_and_backward_reasons(fake_gpu):
    r = reasons(_call(feats={"gate_softplus"}))
    assert any("does not support gate_softplus" in x for x in r)
    assert any("no softplus gate" in x for x in r)
    r = reasons(_call(feats={"qk_l2norm"}, grad=True))
    assert r == [CK.BACKWARD_L2NORM_REASON]
    assert "cuDNN KDA backward needs q/k pre-normalised (use_qk_l2norm=False)" in r[0]
    r = reasons(_call(feats={"gate_lower_bound"}, grad=True))
    assert len(r) == 1 and "backward takes the log decay g only" in r[0]
    r = reasons(_call(feats={"gva"}, grad=True))
    assert len(r) == 1 and "no GVA" in r[0]
    assert reasons(_call(grad=True, compiling=True)) == []       # traced forward + backward: verified on an H200
    assert len(reasons(_call(feats={"qk_l2norm", "gva", "gate_lower_bound"}, grad=True))) == 3
    # the same features without gradients are fine
    assert reasons(_call(feats={"qk_l2norm", "gva", "gate_lower_bound"})) == []


def test_strong_decay_is_declared(fake_gpu, monkeypatch):
    """g below MIN_LOG_DECAY (read from the values for an explicit cuDNN call) is refused by name; the triton and
    torch backends take it; the probe reads nothing for CPU tensors, gated calls or auto."""
    r = reasons(_call(feats={"strong_decay"}))
    assert any("does not support strong_decay" in x for x in r) and CK.STRONG_DECAY_REASON in r
    assert "NaN for log decays g below about -5" in CK.STRONG_DECAY_REASON
    for name in ("triton", "torch"):
        assert "strong_decay" in B.BACKENDS[name].capabilities["kda"].features
    g = torch.tensor([[-1.0, -6.0]])
    assert not CK.log_decay_out_of_range(g, None)                          # CPU: never read
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    as_cuda = _as_cuda(g, monkeypatch)
    assert CK.log_decay_out_of_range(as_cuda, None)
    assert not CK.log_decay_out_of_range(as_cuda, torch.zeros(1))           # the A_log gate: g is not a decay
    assert not CK.log_decay_out_of_range(_as_cuda(torch.tensor([-4.0, -1.0]), monkeypatch), None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not CK.log_decay_out_of_range(as_cuda, None)                     # traced by torch.compile: skipped
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setenv("DELTA_ATTN_SKIP_VALUE_CHECKS", "1")
    assert not CK.log_decay_out_of_range(as_cuda, None)                     # the user skips value checks
    monkeypatch.delenv("DELTA_ATTN_SKIP_VALUE_CHECKS")
    assert CK.log_decay_out_of_range(as_cuda, None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not CK.log_decay_out_of_range(as_cuda, None)                     # under capture: skipped (documented)


def _as_cuda(g: torch.Tensor, monkeypatch):
    """A stand-in for a CUDA tensor holding g's values: torch.aminmax reads them; it has no amax (a reduction of
    its own would raise)."""
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda x: real(x.values) if isinstance(x, types.SimpleNamespace) else real(x))
    return types.SimpleNamespace(numel=g.numel, device=torch.device("cuda"), values=g)


@pytest.mark.parametrize("top", [0.5, -0.25])
def test_the_range_read_serves_the_pending_sign_check(top, monkeypatch):
    """The one pass that reads g's minimum for cuDNN also gives its maximum to the call's pending g <= 0 check,
    which then raises (or passes) on it without reducing g again (the stand-in has no amax)."""
    from delta_attn import _checks as C
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    g = _as_cuda(torch.tensor([-1.0, top, -2.0]), monkeypatch)
    pending = C.PendingChecks()
    C.log_decay("g", g, pending=pending)
    with pending.routing():
        assert not CK.log_decay_out_of_range(g, None)
    assert pending.decays[0].top == top
    if top > 0:
        with pytest.raises(ValueError, match="got a value of 0.5"):
            pending.finish()
    else:
        pending.finish()


def test_explain_reads_strong_decay_as_the_explicit_call_does(monkeypatch):
    """``da.explain(da.kda, ..., backend="cudnn")`` builds the call exactly as ``da.kda`` does, so the value-read
    strong_decay feature is in both (explain once said cuDNN runs a call that then refused it); auto reads nothing."""
    monkeypatch.setattr(CK, "log_decay_out_of_range", lambda g, A_log: True)
    q = k = v = g = torch.zeros(1, 3, 1, 8)
    beta = torch.zeros(1, 3, 1)
    assert "strong_decay" in da.explain(da.kda, q, k, v, g, beta, backend="cudnn").call.features
    assert "strong_decay" not in da.explain(da.kda, q, k, v, g, beta).call.features


def test_explicit_backend_raises_with_the_named_reason(fake_gpu):
    with pytest.raises(UnsupportedError, match=r"pre-normalised \(use_qk_l2norm=False\)"):
        B.select(_call(feats={"qk_l2norm"}, grad=True), "cudnn")
    with pytest.raises(UnsupportedError, match="supports bfloat16"):
        B.select(_call(dtype=torch.float16), "cudnn")
    # and the public API on CPU tensors names the device
    q = torch.randn(1, 4, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="runs on cuda tensors, got cpu"):
        da.kda(q, q, q, -torch.rand(1, 4, 1, 128), torch.rand(1, 4, 1), backend="cudnn")


def test_auto_tries_cudnn_first_only_for_dense_training_calls_it_measured_faster(fake_gpu, monkeypatch):
    """auto's kda rule (ops/kda/register.py), where Triton's training runs its Triton kernels (not Triton 3.6): cuDNN
    first for training calls on dense batches of sequences up to 32768 tokens that cuDNN can run on sm_90; Triton
    first for the rest, and explain says why."""
    monkeypatch.setattr(KR, "_triton_trains_on_gluon", lambda call: False)
    train = dict(feats={"initial_state", "final_state"}, grad=True)
    assert auto_order(_call(seqlen=4096, **train))[:2] == ("cudnn", "triton")
    assert auto_order(_call(seqlen=32768, **train))[0] == "cudnn"
    assert auto_order(_call(seqlen=65536, **train))[:2] == ("triton", "torch")          # measured even there
    assert auto_order(_call(seqlen=0, **train))[0] == "triton"                          # varlen: graph per total
    assert auto_order(_call(seqlen=4096, feats={"varlen"}, grad=True))[0] == "triton"
    assert auto_order(_call(seqlen=1024))[0] == "triton"                                # forward: graph per shape
    assert auto_order(_call(seqlen=1024, feats={"qk_l2norm"}, grad=True))[0] == "triton"    # cuDNN refuses
    assert auto_order(_call(seqlen=1024, dtype=torch.float16, grad=True))[0] == "triton"
    assert auto_order(_call(seqlen=1024, feats={"strong_decay"}, grad=True))[0] == "triton"
    assert auto_order(_call(seqlen=1024, op="kda_step", grad=True))[0] == "triton"
    ex = explain_call(_call(seqlen=4096, **train))
    assert ex.chosen == "cudnn" and "1.45-2.2x faster" in str(ex)
    ex = explain_call(_call(seqlen=1024))
    assert ex.chosen == "triton" and "forward only" in str(ex) and "40 ms" in str(ex)
    assert "longer than 32768" in str(explain_call(_call(seqlen=65536, **train)))
    ex = explain_call(_call(seqlen=1024, feats={"qk_l2norm"}, grad=True))
    assert ex.chosen == "triton" and CK.BACKWARD_L2NORM_REASON in dict(ex.considered)["cudnn"]
    fake_gpu["cc"] = (10, 0)
    assert auto_order(_call(seqlen=4096, **train))[0] == "triton"
    fake_gpu["cc"], fake_gpu["cudnn"] = (9, 0), False
    assert auto_order(_call(seqlen=4096, **train))[0] == "triton"


def test_auto_over_the_gluon_training_kernels(fake_gpu, monkeypatch):
    """Where Triton's training runs its sm_90 Gluon kernels (Triton 3.6), Triton goes first at every length (measured
    faster than cuDNN through both backends); explain says which kernels and why."""
    monkeypatch.setattr(KR, "_triton_trains_on_gluon", lambda call: True)
    train = dict(feats={"initial_state", "final_state"}, grad=True)
    for seqlen in (512, 1024, 2048, 4096, 32768, 65536):
        assert auto_order(_call(seqlen=seqlen, **train))[:2] == ("triton", "torch"), seqlen
    ex = explain_call(_call(seqlen=1024, **train))
    assert ex.chosen == "triton" and "Gluon" in str(ex) and "1.06-1.19x" in str(ex)
    assert "longer than 32768" in str(explain_call(_call(seqlen=65536, **train)))
    monkeypatch.setattr(KR, "_triton_trains_on_gluon", lambda call: False)
    assert auto_order(_call(seqlen=1024, **train))[:2] == ("cudnn", "triton")


def test_gluon_training_kernels_decide_by_the_installed_triton(monkeypatch):
    """The rule asks whether the installed Triton runs the Gluon kernels on the call's device (the release they are
    written for, Gluon available: not on CPU, not under the interpreter)."""
    from delta_attn.ops import _gluon
    monkeypatch.setattr(_gluon, "kernels_release", lambda device: device.type == "cuda")
    assert KR._triton_trains_on_gluon(_call(grad=True))
    monkeypatch.setattr(_gluon, "kernels_release", lambda device: False)
    assert not KR._triton_trains_on_gluon(_call(grad=True))
    monkeypatch.undo()
    assert not _gluon.kernels_release(torch.device("cpu"))


def test_auto_reads_the_decay_range_only_where_it_would_try_cudnn(fake_gpu, monkeypatch):
    """The host read of g's range (cuDNN's engine returns NaN below -5) happens for backend='cudnn' and for auto
    calls that would try cuDNN first, and sends those to Triton when g is out of range."""
    reads = []
    monkeypatch.setattr(CK, "log_decay_out_of_range", lambda g, A_log: reads.append(1) or True)
    args = types.SimpleNamespace(g=None, A_log=None, call=lambda op, strong_decay=False: _call(
        seqlen=4096, feats={"strong_decay"} if strong_decay else set(), grad=True))
    assert "strong_decay" in api._call(args, "kda", "auto").features and len(reads) == 1
    assert "strong_decay" not in api._call(args, "kda", "triton").features and len(reads) == 1
    args.call = lambda op, strong_decay=False: _call(seqlen=4096)          # forward only: Triton first, no read
    assert "strong_decay" not in api._call(args, "kda", "auto").features and len(reads) == 1


def test_auto_does_not_try_cudnn_on_a_decay_range_it_cannot_read(fake_gpu, monkeypatch):
    """With value checks off (torch.compile, CUDA-graph capture, a context-parallel plan), auto cannot read g's
    range, so a call it would send to cuDNN is declared decay_unread, which cuDNN refuses with the reason; an
    explicit backend='cudnn' still runs it (the caller keeps g in range) and a gated call needs no read."""
    from delta_attn import _checks as C
    reads = []
    monkeypatch.setattr(CK, "log_decay_out_of_range", lambda g, A_log: reads.append(1) or False)

    def args(A_log=None):
        return types.SimpleNamespace(g=None, A_log=A_log, call=lambda op, strong_decay=False, decay_unread=False: _call(
            seqlen=4096, grad=True, feats=({"decay_unread"} if decay_unread else set())
            | ({"strong_decay"} if strong_decay else set())))

    with C.values_checked():
        call = api._call(args(), "kda", "auto")
        assert "decay_unread" in call.features and reads == []
        assert CK.DECAY_UNREAD_REASON in reasons(call) and auto_order(call)[0] == "triton"
        # an explicit cudnn call and a gated one go on to the range check (which itself skips the read here)
        assert "decay_unread" not in api._call(args(), "kda", "cudnn").features and len(reads) == 1
        assert "decay_unread" not in api._call(args(A_log=object()), "kda", "auto").features and len(reads) == 2
    assert "decay_unread" not in api._call(args(), "kda", "auto").features and len(reads) == 3


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def test_frontend_probe(monkeypatch):
    monkeypatch.setattr(CK, "_PROBES", {})
    monkeypatch.setattr(CK, "_FE", {})
    monkeypatch.setitem(sys.modules, "cudnn", _module("cudnn"))
    monkeypatch.setitem(sys.modules, "cudnn.linear_attention", _module("cudnn.linear_attention"))
    why = CK.frontend_error()
    assert why and ">= 1.32" in why and "AttributeError" in why
    with pytest.raises(UnsupportedError, match=">= 1.32"):
        CK._frontend()
    fn = lambda *a, **k: None   # noqa: E731
    monkeypatch.setattr(CK, "_PROBES", {})
    monkeypatch.setitem(sys.modules, "cudnn.linear_attention", _module("cudnn.linear_attention", kimi_delta_attention=fn))
    assert CK.frontend_error() is None and CK._frontend() is fn


def test_toolchain_probe(monkeypatch):
    def probe(raiser):
        monkeypatch.setattr(CK, "_PROBES", {})
        monkeypatch.setattr(CK.importlib, "import_module", raiser)
        return CK.toolchain_error()

    def no_module(name):
        def f(_):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return f

    assert "cuda not installed" in probe(no_module("cuda"))
    assert probe(no_module("cudnn.linear_attention.cake")) is None        # another frontend layout: not guessed
    headers = "CUDA headers (cuda_bf16.h) not found; set CUDA_HOME or install nvidia-cuda-runtime"

    def missing_headers(_):
        def dirs():
            raise RuntimeError(headers)
        return _module("compiler", cuda_include_dirs=dirs)
    why = probe(missing_headers)
    assert headers in why and "NVRTC" in why
    assert probe(lambda _: _module("compiler", cuda_include_dirs=lambda: ("/usr/local/cuda/include",))) is None


# ---------------------------------------------------------------------------------------------
# the adapter against a fake frontend implementing the THD contract
# ---------------------------------------------------------------------------------------------

class FakeFrontend:
    """``kimi_delta_attention`` per the cuDNN docstring, in float64, written in cuDNN's own orientation
    (state S (HO, V, K): decay on the K axis, o_t = S_t q_t). Records every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, batch_invariant=False, use_beta_sigmoid_in_kernel=False,
                 allow_neg_eigval=False, safe_gate=False, gate_lower_bound=None, gate_domain="log", a_log=None,
                 dt_bias=None, checkpoint_every_n_tokens=0, checkpoint_dtype=None, plan_name=None,
                 overwrite_initial_state=False, state_indices=None):
        self.calls.append(dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, scale=scale,
                               initial_state=initial_state, output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, safe_gate=safe_gate,
                               gate_lower_bound=gate_lower_bound, a_log=a_log, dt_bias=dt_bias))
        # the THD contract
        assert q.dim() == 3, "expected THD [total_tokens, heads, dim] tensors"
        total, H, K = q.shape
        HK, HV, V = k.shape[1], v.shape[1], v.shape[2]
        assert HK in (H, HV) and k.shape == (total, HK, K)
        HO = max(H, HV)
        assert v.shape[0] == total and g.shape == (total, HO, K) and beta.shape == (total, HO)
        assert g.dtype in (torch.float32, torch.bfloat16, torch.float16), g.dtype
        assert beta.dtype in (torch.float32, q.dtype), beta.dtype
        assert cu_seqlens.dtype in (torch.int32, torch.int64) and cu_seqlens.dim() == 1
        cu = cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == total
        N = len(cu) - 1
        if initial_state is not None:
            assert initial_state.shape == (N, HO, V, K) and initial_state.dtype in (torch.float32, torch.bfloat16)
        if safe_gate:
            assert a_log is None or a_log.shape == (HO,)
            assert dt_bias is None or dt_bias.shape == (HO, K)
        else:
            assert a_log is None and dt_bias is None and gate_lower_bound is None
        assert not (use_beta_sigmoid_in_kernel or allow_neg_eigval or overwrite_initial_state)
        assert state_indices is None and gate_domain == "log" and checkpoint_every_n_tokens == 0
        scale = 1.0 / math.sqrt(K) if scale is None else scale
        f = torch.float64
        qf, kf, vf, gf, bf = (t.to(f) for t in (q, k, v, g, beta))
        if use_qk_l2norm_in_kernel:      # x * rsqrt(sum(x^2) + 1e-6)
            qf = qf * torch.rsqrt(qf.pow(2).sum(-1, keepdim=True) + 1e-6)
            kf = kf * torch.rsqrt(kf.pow(2).sum(-1, keepdim=True) + 1e-6)
        if safe_gate:                    # gate_lower_bound * sigmoid(exp(a_log) * (g + dt_bias))
            lb = -5.0 if gate_lower_bound is None else gate_lower_bound
            ea = torch.ones(HO, dtype=f) if a_log is None else a_log.to(f).exp()
            db = torch.zeros(HO, K, dtype=f) if dt_bias is None else dt_bias.to(f)
            gf = lb * torch.sigmoid(ea[None, :, None] * (gf + db[None]))
        heads_qk = torch.arange(HO) // (HO // H)     # value head j reads query head j // (HV / H)
        qf, kf = qf[:, heads_qk], kf[:, heads_qk]
        outs, finals = [], []
        for n in range(N):
            S = (initial_state[n].to(f) if initial_state is not None else torch.zeros(HO, V, K, dtype=f))
            for t in range(cu[n], cu[n + 1]):
                S = S * gf[t].exp()[:, None, :]
                pred = torch.einsum("hvk,hk->hv", S, kf[t])
                S = S + torch.einsum("hv,hk->hvk", bf[t][:, None] * (vf[t] - pred), kf[t])
                outs.append(torch.einsum("hvk,hk->hv", S, scale * qf[t]))
            finals.append(S)
        o = (torch.stack(outs) if outs else vf.new_zeros(0, HO, V)).to(q.dtype)
        state_dtype = initial_state.dtype if initial_state is not None else torch.float32
        final = torch.stack(finals).to(state_dtype) if output_final_state else q.new_empty(0, dtype=state_dtype)
        return o, final


@pytest.fixture
def fake_fe(monkeypatch):
    fe = FakeFrontend()
    monkeypatch.setattr(CK, "_FE", {"kda": fe})
    monkeypatch.setattr(CK, "_PROBES", {"frontend": None})
    return fe


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def make(B=2, T=23, H=2, HV=2, K=16, V=8, dtype=torch.float32, h0=False, cu=None, gate=None, normed=True):
    n = B if cu is None else len(cu) - 1
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    if normed:       # the regime the cuDNN kernels are built for: |k| <= 1
        q, k = _unit(q), _unit(k)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g = (torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K) + 2.0) if gate is None
         else torch.randn(B, T, HV, K)).to(dtype)
    beta = torch.rand(B, T, HV, dtype=dtype)
    kw = {}
    if h0:
        kw["initial_state"] = torch.randn(n, HV, K, V) * 0.5
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    if gate is not None:
        kw.update(A_log=torch.randn(HV) * 0.5, lower_bound=-3.0)
        if gate == "dt_bias":
            kw["dt_bias"] = torch.randn(HV * K) * 0.5
    return [q, k, v, g, beta], kw


def run_adapter(xs, kw, **opts):
    """The adapter on validated args (what dispatch hands it)."""
    return CK.kda(api.validate(*xs, **kw, **opts))


def ref64(xs, kw, **opts):
    xs = [x.double() for x in xs]
    kw = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in kw.items()}
    return reference.kda(*xs, **kw, **opts)


def close(a, b, tol=2e-5):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert err <= tol * max(1.0, b.abs().max().item()), err


def test_dense_batch_layout_views_and_state_transposes(fake_fe):
    xs, kw = make(B=3, T=37, h0=True)
    o, s = run_adapter(xs, kw, use_qk_l2norm=True, output_final_state=True)
    o64, s64 = ref64(xs, kw, use_qk_l2norm=True, output_final_state=True)
    close(o, o64)
    close(s, s64)
    assert o.shape == (3, 37, 2, 8) and s.shape == (3, 2, 16, 8) and s.dtype == torch.float32 and s.is_contiguous()
    (c,) = fake_fe.calls
    # THD views of the caller's memory: no copies of q, k, v
    for name, x in zip("qkv", xs[:3]):
        assert c[name].data_ptr() == x.data_ptr() and c[name].shape == (3 * 37,) + x.shape[2:]
    assert c["g"].dtype == torch.float32 and c["beta"].dtype == torch.float32 and c["beta"].shape == (111, 2)
    assert c["cu_seqlens"].dtype == torch.int32 and c["cu_seqlens"].tolist() == [0, 37, 74, 111]
    # the state goes in as (N, HV, V, K): the transpose of ours, contiguous float32
    h0 = c["initial_state"]
    assert h0.shape == (3, 2, 8, 16) and h0.is_contiguous() and h0.dtype == torch.float32
    assert torch.equal(h0, kw["initial_state"].transpose(-1, -2))
    assert c["use_qk_l2norm_in_kernel"] is True and c["output_final_state"] is True
    assert c["scale"] == pytest.approx(16 ** -0.5) and c["safe_gate"] is False


def test_state_orientation_is_detected(fake_fe):
    # a non-symmetric state that only matters through its orientation: one sequence, no decay
    xs, kw = make(B=1, T=5, K=8, V=8, h0=True)
    o, s = run_adapter(xs, kw, output_final_state=True)
    o64, s64 = ref64(xs, kw, output_final_state=True)
    close(o, o64)
    close(s, s64)
    o_wrong, _ = ref64(xs, dict(kw, initial_state=kw["initial_state"].transpose(-1, -2).contiguous()),
                       output_final_state=True)
    assert (o64 - o_wrong).abs().max() > 1e-2      # the test could tell a missing transpose


def test_varlen_with_an_empty_sequence(fake_fe):
    cu = [0, 5, 5, 40, 63]
    xs, kw = make(B=1, T=63, h0=True, cu=cu)
    o, s = run_adapter(xs, kw, output_final_state=True)
    o64, s64 = ref64(xs, kw, output_final_state=True)
    close(o, o64)
    close(s, s64)
    close(s[1], kw["initial_state"][1])             # the empty sequence keeps its state
    assert fake_fe.calls[0]["cu_seqlens"] is kw["cu_seqlens"]


@pytest.mark.parametrize("H,HV", [(2, 4), (1, 4), (2, 8)])
def test_gva(fake_fe, H, HV):
    xs, kw = make(B=2, T=19, H=H, HV=HV, h0=True)
    o, s = run_adapter(xs, kw, output_final_state=True, use_qk_l2norm=True)
    o64, s64 = ref64(xs, kw, output_final_state=True, use_qk_l2norm=True)
    close(o, o64)
    close(s, s64)
    c = fake_fe.calls[0]
    assert c["q"].shape[1] == H and c["k"].shape[1] == H and c["v"].shape[1] == HV and c["g"].shape[1] == HV


@pytest.mark.parametrize("gate", ["dt_bias", "no_dt_bias"])
def test_lower_bound_gate_maps_to_the_safe_gate(fake_fe, gate):
    xs, kw = make(B=2, T=21, HV=4, gate=gate)
    o, _ = run_adapter(xs, kw)
    o64, _ = ref64(xs, kw)
    close(o, o64)
    c = fake_fe.calls[0]
    assert c["safe_gate"] is True and c["gate_lower_bound"] == -3.0
    assert c["a_log"].shape == (4,) and torch.equal(c["a_log"], kw["A_log"])
    assert c["dt_bias"].shape == (4, 16) and c["dt_bias"].dtype == torch.float32
    want = kw["dt_bias"].view(4, 16) if gate == "dt_bias" else torch.zeros(4, 16)
    assert torch.equal(c["dt_bias"], want)
    # g reaches cuDNN raw (the gate is applied there), not as a log decay computed here
    assert torch.equal(c["g"], xs[3].reshape(42, 4, 16))


def test_softplus_gate_is_refused_by_the_adapter_too(fake_fe):
    xs, kw = make(gate="dt_bias")
    kw.pop("lower_bound")
    with pytest.raises(UnsupportedError, match="softplus"):
        run_adapter(xs, kw)
    assert fake_fe.calls == []


def test_custom_scale(fake_fe):
    xs, kw = make()
    o, _ = run_adapter(xs, kw, scale=0.3)
    close(o, ref64(xs, kw, scale=0.3)[0])
    assert fake_fe.calls[-1]["scale"] == 0.3       # forward only: passed as it is
    # with gradients the kernel runs at 1/sqrt(128) (its backward bakes it in) and o is rescaled
    xs = [x.requires_grad_() for x in xs]
    o, _ = run_adapter(xs, kw, scale=0.3)
    assert fake_fe.calls[-1]["scale"] == pytest.approx(128 ** -0.5)
    close(o, ref64(xs, kw, scale=0.3)[0])
    do = torch.randn_like(o)
    gq, = torch.autograd.grad((o * do).sum(), xs[0])
    leaves = [x.detach().double().requires_grad_() for x in xs]
    o64, _ = reference.kda(*leaves, scale=0.3)
    gq64, = torch.autograd.grad((o64 * do.double()).sum(), leaves[0])
    close(gq, gq64)


def test_default_scale_with_gradients_is_passed_unchanged(fake_fe):
    xs, kw = make(K=128, V=8)
    xs = [x.requires_grad_() for x in xs]
    run_adapter(xs, kw)
    assert fake_fe.calls[-1]["scale"] == 128 ** -0.5


@pytest.mark.parametrize("varlen", [False, True])
def test_gradients_reach_every_input_through_the_layout(fake_fe, varlen):
    cu = [0, 7, 7, 30] if varlen else None
    xs, kw = make(B=1 if varlen else 2, T=30 if varlen else 15, h0=True, cu=cu)
    kw["initial_state"] = kw["initial_state"].double()          # a float64 state: its gradient comes back float64
    leaves = [x.requires_grad_() for x in xs] + [kw["initial_state"].requires_grad_()]
    o, s = run_adapter(xs, kw, output_final_state=True)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves)
    l64 = [x.detach().double().requires_grad_() for x in leaves]
    o64, s64 = reference.kda(*l64[:5], **dict(kw, initial_state=l64[5]), output_final_state=True)
    g64 = torch.autograd.grad((o64 * do.double()).sum() + (s64 * ds.double()).sum(), l64)
    for name, a, b, x in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads, g64, leaves):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        close(a, b, tol=5e-5)


def test_gradients_in_half_precision_come_back_in_the_input_dtypes(fake_fe):
    xs, kw = make(dtype=torch.float16)
    xs[4] = xs[4].float()                         # beta may be float32 with fp16 q
    leaves = [x.requires_grad_() for x in xs]
    o, _ = run_adapter(xs, kw)
    grads = torch.autograd.grad(o.float().sum(), leaves)
    assert [g.dtype for g in grads] == [torch.float16] * 4 + [torch.float32]
    assert all(torch.isfinite(g).all() for g in grads)
    c = fake_fe.calls[0]
    assert c["g"].dtype == torch.float32 and c["beta"].dtype == torch.float32


def test_no_tokens_returns_the_initial_state(fake_fe):
    xs, kw = make(B=2, T=0, h0=True)
    o, s = run_adapter(xs, kw, output_final_state=True)
    assert o.shape == (2, 0, 2, 8) and torch.equal(s, kw["initial_state"]) and s.data_ptr() != kw["initial_state"].data_ptr()
    xs, kw = make(B=2, T=0)
    o, s = run_adapter(xs, kw, output_final_state=True)
    assert torch.equal(s, torch.zeros(2, 2, 16, 8))
    assert fake_fe.calls == []


def test_prenorm_is_the_in_kernel_normalisation():
    x = torch.randn(3, 5, 2, 64, dtype=torch.bfloat16) * 4
    y = CK.prenorm(x)
    assert y.dtype == torch.bfloat16
    want = reference.l2norm(x.double())
    assert (y.double() - want).abs().max() <= 2 ** -8     # one bf16 rounding of a value <= 1
    # normalised outside with use_qk_l2norm=False == normalised inside
    xs, kw = make(normed=False)
    o_in = reference.kda(*[t.double() for t in xs], use_qk_l2norm=True)[0]
    o_out = reference.kda(CK.prenorm(xs[0]).double(), CK.prenorm(xs[1]).double(), *[t.double() for t in xs[2:]])[0]
    close(o_out, o_in, tol=1e-5)


# ---------------------------------------------------------------------------------------------
# through dispatch and the benchmark row (the capability widened to CPU float32 for the fake)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def cudnn_on_cpu(fake_fe, monkeypatch):
    cap = B.BACKENDS["cudnn"].capabilities["kda"]
    monkeypatch.setitem(B.BACKENDS["cudnn"].capabilities, "kda", Capability(
        impl=cap.impl, device_types=("cpu",), dtypes=(torch.float32,), features=cap.features,
        head_dims=None, check=cap.check))
    return fake_fe


def test_public_api_reaches_the_adapter(cudnn_on_cpu):
    xs, kw = make(B=2, T=9, h0=True)
    o, s = da.kda(*xs, **kw, output_final_state=True, use_qk_l2norm=True, backend="cudnn")
    o64, s64 = ref64(xs, kw, output_final_state=True, use_qk_l2norm=True)
    close(o, o64)
    close(s, s64)
    assert len(cudnn_on_cpu.calls) == 1
    # training with in-kernel normalisation is refused before anything runs
    xs[0].requires_grad_()
    with pytest.raises(UnsupportedError, match="pre-normalised"):
        da.kda(*xs, **kw, use_qk_l2norm=True, backend="cudnn")
    assert len(cudnn_on_cpu.calls) == 1


def test_bench_rows(cudnn_on_cpu):
    from delta_attn.bench import cases, impls
    rows = {i.name: i for i in impls.catalogue("kda", torch.device("cpu"))}
    assert "delta-attn cudnn" in rows and "delta-attn cudnn (q/k normed in torch)" in rows
    case = dict(op="kda", B=1, S=20, H=2, D=16)
    dev, dt = torch.device("cpu"), torch.float32
    # the plain row runs the in-kernel L2 norm, so cuDNN cannot take its backward; the pre-normed row can
    assert "pre-normalised" in rows["delta-attn cudnn"].why_not(case, dev, dt, True)
    assert rows["delta-attn cudnn"].why_not(case, dev, dt, False) is None
    row = rows["delta-attn cudnn (q/k normed in torch)"]
    assert row.why_not(case, dev, dt, True) is None and row.backward
    bound = row.bind(case, cases.make_inputs(case, dev, dt, seed=0))
    out = bound.fn()
    assert cudnn_on_cpu.calls[-1]["use_qk_l2norm_in_kernel"] is False
    want = bound.spec([x.detach().double() for x in bound.leaves], True)
    close(out, want, tol=1e-4)
    out.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in bound.leaves)


def test_unavailable_on_cpu_by_default():
    from delta_attn.bench import impls
    rows = {i.name: i for i in impls.catalogue("kda", torch.device("cpu"))}
    why = rows["delta-attn cudnn (q/k normed in torch)"].why_not(dict(op="kda", B=1, S=20, H=2, D=128),
                                                                  torch.device("cpu"), torch.bfloat16, True)
    assert why and "runs on cuda tensors, got cpu" in why
