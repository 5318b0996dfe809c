"""``backend="cudnn"`` for KDA: cuDNN frontend's ``cudnn.linear_attention.kimi_delta_attention``.

The frontend (``nvidia-cudnn-frontend`` >= 1.32) ships KDA as a ``torch.library`` custom op with
autograd in the THD layout: q (total, H, K), k (total, H, K), v (total, HV, V), g (total, HV, K),
beta (total, HV), ``cu_seqlens`` (N + 1), states (N, HV, V, K), i.e. each state is the transpose of
ours (N, HV, K, V). This module only converts layouts and arguments; the arithmetic is cuDNN's.

What runs on an sm_90 GPU is the frontend's Hopper engine ``kda_hopper_cuda`` (CUDA C++ compiled at
run time with NVRTC through cuda-python); its other engines need nvidia-cutlass-dsl (CuTe DSL) or
cuda-tile on newer GPUs and are not declared here. That engine fixes what the capability declares:

* forward: bf16 q/k/v, K = V = 128, any scale, varlen, initial / final state, in-kernel q/k L2 norm,
  GVA (HV a multiple of H, value head hv reading query head hv // (HV / H), as ours), and the
  "safe gate" ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` -- exactly our
  ``lower_bound`` gate form (``kda_fused_sm90.cu: kda_safe_gate``; A_log per value head, dt_bias per
  value head and key channel). There is no softplus gate, so ``-exp(A_log) * softplus(g + dt_bias)``
  is refused.
* backward: log-space g only (no A_log / dt_bias / lower_bound gate), q/k given normalised (no
  in-kernel L2 norm), equal query and value head counts, float32 g and beta, and the scale
  1/sqrt(128) baked in. Gradients reach q, k, v, g, beta and ``initial_state``.

Conversions this adapter does so that a call means exactly what our API says:
  * g and beta are passed as float32 (the kernels read float32; the backward accepts nothing else;
    bf16 -> fp32 is exact and the gradients are cast back by autograd);
  * a custom ``scale`` with gradients: the kernel runs at 1/sqrt(128) and o is multiplied by
    scale * sqrt(128) (o is linear in the scale; one extra rounding of o);
  * ``lower_bound`` without ``dt_bias``: a zero dt_bias (the engine needs both parameters);
  * states: (K, V) <-> (V, K) transposes, copied to contiguous float32 (the final state we return is
    contiguous, as every other backend's, so that ``kda_step`` can take it as its pool).

Inputs are reshaped to THD as views (no copy for contiguous inputs); B > 1 without ``cu_seqlens``
becomes ``cu_seqlens = [0, T, 2T, ..., BT]``.

Numerics note: the Hopper forward splits a long sequence into segments run in parallel and starts a
segment from zero once the decays since an earlier chunk attenuate the carried state below 2^-20
(the cuDNN source bounds the error by about 1e-6 max|S| for beta * |k|^2 <= 2, where the delta rule
is non-expansive: normalised keys and beta in [0, 1] are inside it).

Nothing here imports ``cudnn`` at ``import delta_attn`` time.
"""
from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from ... import _checks as C
from ... import _install
from ... import backends as B
from ...backends import Call, UnsupportedError

if TYPE_CHECKING:   # pragma: no cover
    from .args import KDAArgs

HEAD_DIM = 128                          # the sm_90 engine's only K and V
SM90 = (9, 0)                           # kda_hopper_cuda runs on compute capability 9.0 exactly
BACKWARD_SCALE = HEAD_DIM ** -0.5       # the scale the sm_90 backward kernel bakes in
DTYPES = (torch.bfloat16,)              # the sm_90 engine's q/k/v dtype
FEATURES = frozenset({"varlen", "initial_state", "final_state", "qk_l2norm", "gate_lower_bound", "gva"})
# The sm_90 engine's range of the log decay g: measured on the H200 (bf16, K = V = 128, T = 503), g = -5 at every
# token and channel passed the error rule, g = -8 everywhere (or -10 at 15 % of the entries) returned NaN
MIN_LOG_DECAY = -5.0
STRONG_DECAY_REASON = (f"cuDNN KDA's sm_90 engine returns NaN for log decays g below about {MIN_LOG_DECAY:g} (measured "
                       f"on the H200: -5 everywhere passes, -8 everywhere or -10 at 15 % of the entries give NaN); "
                       f"this call's g goes below {MIN_LOG_DECAY:g}: use backend='triton'")
DECAY_UNREAD_REASON = (f"auto sends a call to cuDNN KDA only after reading that g stays above {MIN_LOG_DECAY:g} "
                       f"(its sm_90 engine returns NaN below), and value checks are off here (torch.compile, "
                       f"CUDA-graph capture or a context-parallel plan): ask for backend='cudnn' to run it, keeping g "
                       f"in range")
INSTALL_HINT = _install.CUDNN        # the frontend, and cuda-python: the sm_90 engine compiles with NVRTC

BACKWARD_L2NORM_REASON = ("cuDNN KDA backward needs q/k pre-normalised (use_qk_l2norm=False): its sm_90 backward "
                          "kernel has no in-kernel L2 norm; normalise q and k before the call "
                          "(delta_attn.ops.kda.cudnn.prenorm)")

# ---------------------------------------------------------------------------------------------
# capability: head dims, environment probes, the extra reasons, the suggested auto rule
# ---------------------------------------------------------------------------------------------


def head_dims(dims) -> Optional[str]:
    kd, vd = dims
    if kd != HEAD_DIM or vd != HEAD_DIM:
        return f"cuDNN KDA (sm_90 engine) needs K = V = {HEAD_DIM}, got K = {kd}, V = {vd}"
    return None


_FE: Dict[str, object] = {}                 # "kda" -> cudnn.linear_attention.kimi_delta_attention
_PROBES: Dict[str, Optional[str]] = {}      # probe name -> reason (None: fine)


@B.trace_constant
def frontend_error() -> Optional[str]:
    """Why ``cudnn.linear_attention.kimi_delta_attention`` cannot be imported (None when it can); once. A constant
    of the graph under torch.compile (dynamo refuses to trace an import)."""
    if "frontend" not in _PROBES:
        try:
            _FE["kda"] = importlib.import_module("cudnn.linear_attention").kimi_delta_attention
            _PROBES["frontend"] = None
        except Exception as e:   # noqa: BLE001 — an old frontend (no linear_attention) or a broken install
            _PROBES["frontend"] = (f"cudnn-frontend is installed but has no usable cudnn.linear_attention."
                                   f"kimi_delta_attention (needs nvidia-cudnn-frontend >= 1.32; "
                                   f"{type(e).__name__}: {e})")
    return _PROBES["frontend"]


@B.trace_constant
def toolchain_error() -> Optional[str]:
    """Why the sm_90 engine could not compile its kernel (cuda-python's NVRTC, the CUDA headers); once (a graph
    constant, as :func:`frontend_error`).
    Asks the frontend's own locator; a frontend without that module is not second-guessed."""
    if "toolchain" not in _PROBES:
        why = None
        try:
            compiler = importlib.import_module("cudnn.linear_attention.cake.compiler")
            compiler.cuda_include_dirs()
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("cudnn"):
                why = f"{e.name} not installed"
        except Exception as e:   # noqa: BLE001 — the locator's own error names what is missing
            why = f"{type(e).__name__}: {e}"
        _PROBES["toolchain"] = None if why is None else (
            f"cuDNN KDA's sm_90 engine compiles its kernel with NVRTC at run time and needs cuda-python and the "
            f"CUDA headers ({why}) — {INSTALL_HINT}")
    return _PROBES["toolchain"]


def log_decay_out_of_range(g: torch.Tensor, A_log: Optional[torch.Tensor]) -> bool:
    """Whether a raw log decay g (no A_log gate) goes below MIN_LOG_DECAY: read from the values, one host
    synchronisation; skipped (False) wherever value checks are (``_checks.value_checks_enabled``: CUDA-graph
    capture, torch.compile tracing, DELTA_ATTN_SKIP_VALUE_CHECKS=1), where the caller must keep g in range. One
    pass gives g's minimum and maximum: where the call's g <= 0 check is pending, the maximum is handed to it
    (``_checks.decay_top_sink``), which then reads g no more."""
    if A_log is not None or g.numel() == 0 or g.device.type != "cuda" or not C.value_checks_enabled():
        return False
    low, high = torch.aminmax(g)
    low, high = torch.stack((low, high)).tolist()
    report = C.decay_top_sink(g)
    if report is not None:
        report(high)
    return bool(low < MIN_LOG_DECAY)


def check(call: Call) -> List[str]:
    """The reasons beyond dtype / head dims / features / compute capability >= 9.0."""
    reasons: List[str] = []
    if "strong_decay" in call.features:
        reasons.append(STRONG_DECAY_REASON)
    if "decay_unread" in call.features:
        reasons.append(DECAY_UNREAD_REASON)
    if call.device.type == "cuda":
        cc = B.device_capability(call.device)
        if cc is not None and cc > SM90:
            reasons.append(f"cuDNN KDA is declared for its sm_90 engine only (compute capability 9.0), device has "
                           f"{cc[0]}.{cc[1]}: the frontend's engines for newer GPUs need nvidia-cutlass-dsl or "
                           f"cuda-tile and are not declared here")
        if B.package_available("cudnn"):
            why = frontend_error() or toolchain_error()
            if why:
                reasons.append(why)
    if "gate_softplus" in call.features:
        reasons.append("cuDNN KDA has no softplus gate -exp(A_log) * softplus(g + dt_bias) (only the lower_bound "
                       "form lower_bound * sigmoid(exp(A_log) * (g + dt_bias))): pass the log decay as g instead")
    if call.needs_grad:
        if "qk_l2norm" in call.features:
            reasons.append(BACKWARD_L2NORM_REASON)
        if "gate_lower_bound" in call.features:
            reasons.append("cuDNN KDA backward takes the log decay g only (its sm_90 backward kernel has no "
                           "A_log / dt_bias / lower_bound gate): pass the log decay as g")
        if "gva" in call.features:
            reasons.append("cuDNN KDA backward needs as many value heads as query heads (its sm_90 backward "
                           "kernel has no GVA)")
    return reasons


# ---------------------------------------------------------------------------------------------
# the adapter
# ---------------------------------------------------------------------------------------------


def _frontend():
    fn = _FE.get("kda")
    if fn is None:
        why = frontend_error()
        if why:
            raise UnsupportedError(why)
        fn = _FE["kda"]
    return fn


def prenorm(x: torch.Tensor) -> torch.Tensor:
    """q or k normalised as ``use_qk_l2norm=True`` does (``x * rsqrt(sum(x^2) + 1e-6)`` in float32, back to
    the input dtype): what a caller does before a cuDNN KDA call that needs gradients."""
    from ...reference import l2norm
    return l2norm(x.float()).to(x.dtype)


class _SwapKV(torch.autograd.Function):
    """(…, a, b) -> contiguous float32 (…, b, a); the gradient goes back the same way (contiguous, so the
    frontend never sees a transposed state gradient)."""

    @staticmethod
    def forward(ctx, s):
        ctx.dtype = s.dtype
        return s.transpose(-1, -2).to(torch.float32).contiguous()   # (.to alone keeps a float32 view as it is)

    @staticmethod
    def backward(ctx, ds):
        return ds.transpose(-1, -2).to(ctx.dtype).contiguous()


def _dense_cu_seqlens(b: int, t: int, device) -> torch.Tensor:
    dtype = torch.int32 if b * t < 2 ** 31 else torch.int64
    return torch.arange(0, b * t + 1, t, dtype=dtype, device=device)


def _empty_call(a: "KDAArgs"):
    """No token at all: o is empty; the final state is the initial state (or zeros)."""
    b, t, _, kd = a.q.shape
    hv, vd = a.v.shape[2], a.v.shape[3]
    o = a.v.new_zeros(b, t, hv, vd)
    if not a.output_final_state:
        return o, None
    if a.initial_state is not None:
        return o, a.initial_state.to(torch.float32, copy=True)
    return o, a.q.new_zeros(a.num_seqs, hv, kd, vd, dtype=torch.float32)


def kda(a: "KDAArgs"):
    """Backend entry: the validated call -> ``(o (B, T, HV, V), final_state (N, HV, K, V) float32 or None)``."""
    if a.A_log is not None and a.lower_bound is None:
        raise UnsupportedError("cuDNN KDA has no softplus gate -exp(A_log) * softplus(g + dt_bias)")
    fn = _frontend()
    b, t, h, kd = a.q.shape
    hv, vd = a.v.shape[2], a.v.shape[3]
    total = b * t
    if total == 0 or a.num_seqs == 0:
        return _empty_call(a)
    cu = a.cu_seqlens if a.cu_seqlens is not None else _dense_cu_seqlens(b, t, a.q.device)
    # THD views of our (B, T, ...) tensors; g and beta in float32 (what the kernels read)
    q, k = a.q.reshape(total, h, kd), a.k.reshape(total, h, kd)
    v = a.v.reshape(total, hv, vd)
    g = a.g.reshape(total, hv, kd).float()
    beta = a.beta.reshape(total, hv).float()
    gate = {}
    if a.A_log is not None:     # lower_bound * sigmoid(exp(A_log) * (g + dt_bias)): cuDNN's "safe gate"
        dt_bias = (a.dt_bias.float().reshape(hv, kd) if a.dt_bias is not None
                   else torch.zeros(hv, kd, dtype=torch.float32, device=a.q.device))
        gate = dict(safe_gate=True, gate_lower_bound=float(a.lower_bound), a_log=a.A_log.float(), dt_bias=dt_bias)
    scale, o_factor = float(a.scale), None
    if a.needs_grad() and not math.isclose(scale, BACKWARD_SCALE, rel_tol=1e-12, abs_tol=0.0):
        # the backward kernel bakes in 1/sqrt(128): o = S^T (scale q) is linear in the scale
        scale, o_factor = BACKWARD_SCALE, scale / BACKWARD_SCALE
    h0 = _SwapKV.apply(a.initial_state) if a.initial_state is not None else None
    o, ht = fn(q, k, v, g, beta, cu, scale=scale, initial_state=h0, output_final_state=bool(a.output_final_state),
               use_qk_l2norm_in_kernel=bool(a.use_qk_l2norm), **gate)
    o = o.view(b, t, hv, vd)
    if o_factor is not None:
        o = o * o_factor
    final = _SwapKV.apply(ht) if a.output_final_state else None
    return o, final
