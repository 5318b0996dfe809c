"""Public Kimi Delta Attention entry points (``kda``, ``kda_step``) and their validation.

Each validates every argument before anything runs, builds a :class:`~delta_attn.ops.kda.args.KDAArgs` and hands
it to the backend the registry selects (``register.py`` declares what each backend supports). ``kda`` returns
``(o, final_state or None)``; ``kda_step`` returns o and updates ``state`` in place.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from ... import _checks as C
from ...backends import Call, explain_call, package_available, select
from ...reference import ACCUMULATION_DTYPES
from .._prepare import positive_max_on_gpu
from . import cudnn, register
from .args import KDAArgs

SHAPES = "q, k (B, T, H, K); v (B, T, HV, V); g (B, T, HV, K); beta (B, T, HV)"
# FLA's keywords of chunk_kda / fused_recurrent_kda (fla-core 0.6) that delta-attn spells otherwise or does not
# take: a call that passes one gets a TypeError saying what to pass instead (docs/MIGRATION.md lists them)
_NO_KEYWORD = "delta-attn has no such keyword"
FLA_KEYWORDS = {
    "use_qk_l2norm_in_kernel": "delta-attn's keyword is use_qk_l2norm=",
    "use_gate_in_kernel": "delta-attn has no flag: pass A_log= (and dt_bias=), and g is then the raw gate input",
    "use_beta_sigmoid_in_kernel": f"{_NO_KEYWORD}: pass beta.sigmoid() as beta",
    "allow_neg_eigval": f"{_NO_KEYWORD}: pass 2 * beta.sigmoid() as beta",
    "safe_gate": f"{_NO_KEYWORD}: lower_bound= (any finite value < 0) is the bounded gate",
    "state_v_first": f"{_NO_KEYWORD}: states are (..., K, V); pass a V-first state as state.transpose(-1, -2)",
    "transpose_state_layout": f"{_NO_KEYWORD}: states are (..., K, V); pass a V-first state as "
                              "state.transpose(-1, -2)",
    "cu_seqlens_cpu": "delta-attn's keyword is cu_seqlens= alone (it reads the lengths on the host itself)",
    "cp_context": "context parallelism is delta_attn.distributed.kda (docs/DISTRIBUTED.md)",
    "disable_recompute": f"{_NO_KEYWORD} (no equivalent in this version)",
    "return_intermediate_states": f"{_NO_KEYWORD} (no equivalent in this version)",
    "chunk_size": f"{_NO_KEYWORD}: the backend picks its chunking",
    "use_graph": f"{_NO_KEYWORD}: capture kda_step in a CUDA graph yourself (docs/SERVING.md)",
    "max_num_seqs": f"{_NO_KEYWORD} (no equivalent in this version)",
}
# and those of fused_recurrent_kda's decode use, for kda_step
FLA_STEP_KEYWORDS = dict(
    FLA_KEYWORDS,
    initial_state="kda_step's state (the positional (P, HV, K, V) pool) is read and updated in place",
    output_final_state=f"{_NO_KEYWORD}: kda_step updates state in place and returns o only",
    inplace_final_state=f"{_NO_KEYWORD}: kda_step always updates state in place",
    ssm_state_indices="delta-attn's keyword is state_indices=",
    cu_seqlens=f"{_NO_KEYWORD}: every sequence brings the same T new tokens (q is (B, T, H, K))",
)
# what a positive raw log decay usually means: the gate's input passed without its gate
RAW_GATE_HINT = ("for a raw gate input (any sign) pass A_log (and dt_bias): the decay is then "
                 "-exp(A_log) * softplus(g + dt_bias), FLA's use_gate_in_kernel=True")


def _validate(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias, lower_bound):
    C.tensor("q", q, 4, shape_doc="(B, T, H, K)")
    C.tensor("k", k, 4, shape_doc="(B, T, H, K)")
    C.tensor("v", v, 4, shape_doc="(B, T, HV, V)")
    C.tensor("g", g, 4, shape_doc="(B, T, HV, K)")
    C.tensor("beta", beta, 3, shape_doc="(B, T, HV)")
    C.same_dtype(q=q, k=k, v=v)
    for name, t in (("g", g), ("beta", beta)):
        if t.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}) or float32, got {t.dtype}")
    C.same_device(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    C.shape_equal("k", k, (b, t, h, kd), "(the shape of q)")
    C.dim_equal("batch and length", "v", tuple(v.shape[:2]), "q", (b, t))
    C.positive_dim("q heads", h)
    C.positive_dim("key dim K", kd)
    C.positive_dim("value dim V", vd)
    C.heads_divide("value heads HV (v.shape[2])", hv, "query heads H (q.shape[2])", h)
    C.shape_equal("g", g, (b, t, hv, kd), "(B, T, HV, K)")
    C.shape_equal("beta", beta, (b, t, hv), "(B, T, HV)")
    if scale is None:
        scale = kd ** -0.5
    scale = C.number("scale", scale, finite=True)
    C.flag("use_qk_l2norm", use_qk_l2norm)
    if A_log is None:
        if dt_bias is not None:
            raise ValueError("dt_bias needs A_log: the in-kernel gate is -exp(A_log) * softplus(g + dt_bias)")
        if lower_bound is not None:
            raise ValueError("lower_bound needs A_log: the bounded gate is "
                             "lower_bound * sigmoid(exp(A_log) * (g + dt_bias))")
    else:
        C.tensor("A_log", A_log, 1, ACCUMULATION_DTYPES, "(HV,)")
        C.shape_equal("A_log", A_log, (hv,), "(HV,)")
        if dt_bias is not None:
            C.tensor("dt_bias", dt_bias, 1, ACCUMULATION_DTYPES, "(HV * K,)")
            C.shape_equal("dt_bias", dt_bias, (hv * kd,), "(HV * K,)")
        if lower_bound is not None:
            lower_bound = C.number("lower_bound", lower_bound, doc="a finite number < 0")
            if not lower_bound < 0 or lower_bound == float("-inf"):
                raise ValueError(f"lower_bound must be a finite number < 0, got {lower_bound}")
    return scale, lower_bound


def validate(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
             use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None, allow_tf32=False,
             pending: Optional[C.PendingChecks] = None) -> KDAArgs:
    """The validated call; ``pending``: the check of g's range deferred into it (``C.log_decay``)."""
    # shapes, dtypes, devices, scalars: once per signature (C.memoized); values (g, cu_seqlens): every call
    scale, lower_bound = C.memoized("kda", _validate, q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias,
                                    lower_bound)
    if A_log is None:
        C.log_decay("g", g, RAW_GATE_HINT, pending)
    C.flag("output_final_state", output_final_state)
    C.flag("allow_tf32", allow_tf32)
    b, t, _, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    n = b
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {b}")
        cu_seqlens, n = C.cu_seqlens("cu_seqlens", cu_seqlens, t, q.device)   # int32, contiguous
    C.state("initial_state", initial_state, (n, hv, kd, vd), q.device, "(N, HV, K, V) float32")
    return KDAArgs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, n, use_qk_l2norm,
                   A_log, dt_bias, lower_bound, allow_tf32=allow_tf32)


def _check_step(q, k, v, g, beta, state, state_indices, num_accepted_tokens, scale, use_qk_l2norm, A_log, dt_bias,
                lower_bound):
    """The checks of a decode step that read no device value. Returns (scale, lower_bound) normalised."""
    scale, lower_bound = _validate(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias, lower_bound)
    per_slot = (v.shape[2], q.shape[3], v.shape[3])      # (HV, K, V)
    C.decode_step(q, state, per_slot, "(P, HV, K, V)", state_indices, num_accepted_tokens)
    return scale, lower_bound


def validate_step(q, k, v, g, beta, state, state_indices=None, scale=None, use_qk_l2norm=False, A_log=None,
                  dt_bias=None, lower_bound=None, num_accepted_tokens=None) -> KDAArgs:
    # shapes, dtypes, devices, scalars: once per signature (C.memoized); slot values: every call
    scale, lower_bound = C.memoized("kda_step", _check_step, q, k, v, g, beta, state, state_indices,
                                    num_accepted_tokens, scale, use_qk_l2norm, A_log, dt_bias, lower_bound)
    C.state_indices_value_checks(state_indices, state.shape[0], num_accepted_tokens)
    if A_log is None:
        C.log_decay("g", g, RAW_GATE_HINT)
    b = q.shape[0]
    return KDAArgs(q, k, v, g, beta, scale, None, False, None, b, use_qk_l2norm, A_log, dt_bias, lower_bound,
                   state=state, state_indices=state_indices, num_accepted_tokens=num_accepted_tokens)


def _call(args: KDAArgs, op: str, backend: str) -> Call:
    """``args.call(op)``; where cuDNN would run it (``backend="cudnn"``, or ``auto`` trying cuDNN first) a raw log
    decay below what its kernel takes is read from the values (one host sync: ``cudnn.log_decay_out_of_range``)
    and declared as ``strong_decay``, which cuDNN refuses. Where ``auto`` would try cuDNN but value checks are off,
    the call is declared ``decay_unread``, which cuDNN refuses too (an explicit ``backend="cudnn"`` still runs)."""
    call = args.call(op)
    auto_cudnn = backend == "auto" and register.prefers_cudnn(call)
    if auto_cudnn and args.A_log is None and not C.value_checks_enabled():
        return args.call(op, decay_unread=True)          # auto never runs cuDNN on a range it could not read
    if backend == "cudnn" or auto_cudnn:
        if cudnn.log_decay_out_of_range(args.g, args.A_log):
            return args.call(op, strong_decay=True)
    return call


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None, allow_tf32=False, backend="auto",
        **unknown):
    """Kimi Delta Attention over whole sequences (chunked on the Triton backend).

    q, k (B, T, H, K); v (B, T, HV, V), HV % H == 0; g (B, T, HV, K) log decay (or the raw gate
    when ``A_log`` is given); beta (B, T, HV); ``initial_state`` (N, HV, K, V) float32; with
    ``cu_seqlens`` B == 1 and N = len(cu_seqlens) - 1. Returns ``(o (B, T, HV, V), final_state)``,
    final_state (N, HV, K, V) float32 when ``output_final_state`` else None.

    Domain of the decay: without ``A_log``, g is a log decay and must be <= 0 (``-inf`` resets the state);
    a positive entry is a ``ValueError`` naming g, checked on the host wherever value checks run (not under
    CUDA-graph capture, torch.compile tracing or ``DELTA_ATTN_SKIP_VALUE_CHECKS=1``, where the caller keeps
    g <= 0). A NaN in g is not refused: it makes its own sequence's outputs and state NaN and leaves the
    other sequences of the batch untouched. With ``A_log``, g is the raw gate input and may have any sign.

    Precision: fp16 / bf16 inputs accumulate in fp32; fp32 inputs give fp32-accurate results (IEEE
    dots) unless ``allow_tf32=True``, which lets the Triton backend use tf32 tensor cores (about 1e-3
    relative error; K <= 128 only: larger K stays IEEE). ``scale`` must be finite. A keyword of FLA's
    ``chunk_kda`` that delta-attn spells otherwise (``use_qk_l2norm_in_kernel``...) is a TypeError that says
    what to pass instead.

    >>> import torch, delta_attn as da
    >>> q, k = torch.randn(2, 1, 6, 2, 8).unbind(0)
    >>> v, g, beta = torch.randn(1, 6, 2, 8), -torch.rand(1, 6, 2, 8), torch.rand(1, 6, 2)
    >>> o, s = da.kda(q, k, v, g, beta, output_final_state=True, backend="torch")
    >>> o.shape, s.shape
    (torch.Size([1, 6, 2, 8]), torch.Size([1, 2, 8, 8]))
    """
    C.unknown_keywords("kda", unknown, FLA_KEYWORDS)
    pending = C.PendingChecks()      # g's range: reduced before the kernels, read after (outputs are new)
    args = validate(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                    A_log, dt_bias, lower_bound, allow_tf32, pending)
    return pending.run(lambda: select(_call(args, "kda", backend), backend), args,
                       _check_reduction(args) if pending.decays else None,
                       kernels_report=bool(pending.decays) and _kernels_report(args, backend))


def _check_reduction(args: KDAArgs):
    """The g check's reduction for ``PendingChecks.run``: the small kernel of ``ops/_decay_max.py`` where the call's
    Triton kernels leave it room on every SM (training; the fused forward's warp-specialised form), else None
    (torch's amax, which finishes sooner beside kernels that take every register; docs/PERFORMANCE.md)."""
    if args.needs_grad():
        return positive_max_on_gpu
    if args.q.is_cuda and package_available("triton"):
        from .launch import check_fits_beside      # imports Triton: only for a CUDA call
        if check_fits_beside(args.q, args.v, args.A_log, args.num_seqs):
            return positive_max_on_gpu
    return None


def _kernels_report(args: KDAArgs, backend: str) -> bool:
    """Whether the call's first kernel writes g's maximum for the check (``launch.train_reports_decay``): a training
    call on the Triton backend (where ``auto`` sends a CUDA one) whose intra-chunk stage is the Gluon kernel. The
    host then waits for that kernel alone, with no reduction beside it (docs/PERFORMANCE.md)."""
    if not (args.needs_grad() and package_available("triton")
            and (backend == "triton" or (backend == "auto" and args.q.is_cuda))):
        return False
    from .launch import train_reports_decay         # imports Triton: only for a call that may run it
    return train_reports_decay(args.q, args.v, args.g, args.A_log, args.dt_bias, args.lower_bound, args.allow_tf32)


def kda_step(q, k, v, g, beta, state=None, *, state_indices=None, num_accepted_tokens=None, scale=None,
             use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None, backend="auto", **unknown):
    """Decode: KDA over a few new tokens per sequence from a state pool, updated in place.

    q, k (B, T, H, K) with T new tokens; ``state`` (P, HV, K, V) float32 (or float64). Inference only.
    Returns o (B, T, HV, V). g as in :func:`kda`: without ``A_log`` a log decay <= 0 (a positive entry is a
    ``ValueError``, checked where value checks run). The slots (int32 / int64, on the inputs' device, distinct,
    in [0, P)):

    - ``state_indices`` None: sequence b reads and writes ``state[b]`` (P == B);
    - (B,): sequence b starts from ``state[state_indices[b]]`` and writes its state after the last
      token back there;
    - (B, T), speculative decoding (draft verification): the state after token t of sequence b is
      written to ``state[state_indices[b, t]]`` and the step starts from slot
      ``state_indices[b, num_accepted_tokens[b] - 1]`` (``num_accepted_tokens`` (B,), values in
      [1, T]: how many tokens of the previous step were accepted; None starts from
      ``state_indices[b, 0]``). The engine keeps the slot table and passes the accepted counts of the
      last verification: no state is copied.

    FLA's keywords (``initial_state=``, ``ssm_state_indices=``, ``use_qk_l2norm_in_kernel=``...) are a
    TypeError that says what to pass instead.

    CUDA graphs: the call can be captured (no host synchronisation); under capture the checks that read
    the values of ``state_indices`` / ``num_accepted_tokens`` on the host are skipped (shapes, dtypes and
    devices are still checked), so the captured values must be valid. Run the step once before capturing
    (kernel compilation).

    >>> import torch, delta_attn as da
    >>> q, k = torch.randn(2, 2, 3, 1, 8).unbind(0)           # 2 sequences, 3 tokens (1 + 2 drafts)
    >>> v, g, beta = torch.randn(2, 3, 1, 8), -torch.rand(2, 3, 1, 8), torch.rand(2, 3, 1)
    >>> pool = torch.zeros(8, 1, 8, 8)
    >>> slots = torch.tensor([[0, 1, 2], [4, 5, 6]])          # state after token t -> slots[b, t]
    >>> o = da.kda_step(q, k, v, g, beta, pool, state_indices=slots, backend="torch")
    >>> accepted = torch.tensor([2, 3])                       # next step starts from slots[b, accepted - 1]
    >>> o = da.kda_step(q, k, v, g, beta, pool, state_indices=slots, num_accepted_tokens=accepted,
    ...                 backend="torch")
    >>> o.shape
    torch.Size([2, 3, 1, 8])
    """
    C.unknown_keywords("kda_step", unknown, FLA_STEP_KEYWORDS)
    if state is None:     # required: None only so that FLA's initial_state= above is named first
        raise TypeError("kda_step() missing 1 required positional argument: 'state' (the (P, HV, K, V) state pool, "
                        "updated in place)")
    args = validate_step(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, A_log, dt_bias,
                         lower_bound, num_accepted_tokens)
    return select(args.call("kda_step"), backend)(args)


def _known(fn: str, validator, kw: dict, theirs: dict) -> dict:
    """``kw`` when ``validator`` takes every keyword in it, else the TypeError of the public function (an FLA
    keyword named with what to pass instead): ``explain`` refuses what the call refuses, the same way."""
    C.unknown_keywords(fn, {n: v for n, v in kw.items() if n not in inspect.signature(validator).parameters}, theirs)
    return kw


kda.plan = lambda *a, backend="auto", **kw: explain_call(
    _call(validate(*a, **_known("kda", validate, kw, FLA_KEYWORDS)), "kda", backend), backend)
kda_step.plan = lambda *a, backend="auto", **kw: explain_call(
    validate_step(*a, **_known("kda_step", validate_step, kw, FLA_STEP_KEYWORDS)).call("kda_step"), backend)
