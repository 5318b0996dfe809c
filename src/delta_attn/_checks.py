"""Input validation shared by every operator.

Every public wrapper calls these before anything runs. Each error names the argument, what was
expected and what came, and is a ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong
shape or value). Value checks that need the host to read a device tensor (``cu_seqlens``,
``state_indices``, ``num_accepted_tokens``, the sign of a raw log decay ``g``: :func:`log_decay`) are skipped
while ``torch.compile`` traces, where they would break the graph, and while a CUDA graph is captured, where a
host read is not allowed; shape, dtype and device checks always run.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from . import settings
from .reference import ACCUMULATION_DTYPES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def _tracing() -> bool:
    return torch.compiler.is_compiling()


# Validated argument signatures -> what their checks derived (a normalised scale...), see :func:`memoized`.
_VALIDATED: Dict[tuple, Any] = {}


def memoized(op: str, check: Callable[..., Any], *args) -> Any:
    """``check(*args)``: the shape / dtype / device / scalar checks of one call of ``op`` (none that reads a
    device value: those run on every call), skipped for a signature of ``args`` that passed them before, whose
    result is remembered. The signature is what such checks read: each tensor's type, shape, dtype and device,
    each other argument's type and value. A signature that raised is never remembered (bad input raises on every
    call); while torch.compile traces, or with an unhashable argument, ``check`` runs every time."""
    if _tracing():
        return check(*args)
    key = (op,) + tuple([(type(a), a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a)
                         for a in args])
    try:
        got = _VALIDATED.get(key, _VALIDATED)
    except TypeError:         # an unhashable argument (a list...)
        return check(*args)
    if got is _VALIDATED:
        got = check(*args)
        if len(_VALIDATED) >= 1024:       # bounded: shapes are in the key
            _VALIDATED.clear()
        _VALIDATED[key] = got
    return got


def tensor(name: str, x, ndim: Optional[int] = None, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
           shape_doc: str = "") -> torch.Tensor:
    """``x`` is a tensor of rank ``ndim`` whose dtype is one of ``dtypes``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' ' + shape_doc if shape_doc else ''}, "
                        f"got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D{' ' + shape_doc if shape_doc else ''}, "
                         f"got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_names(dtypes)}, got {x.dtype}")
    return x


def same_dtype(**tensors: Optional[torch.Tensor]) -> torch.dtype:
    first_name = dtype = None
    for n, t in tensors.items():
        if t is None:
            continue
        if first_name is None:
            first_name, dtype = n, t.dtype
        elif t.dtype != dtype:
            raise TypeError(f"{n} must have the dtype of {first_name} ({dtype}), got {t.dtype}")
    return dtype


def same_device(**tensors: Optional[torch.Tensor]) -> torch.device:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    for n, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
    first_name, first = named[0]
    device = first.device
    for n, t in named[1:]:
        if t.device != device:
            raise ValueError(f"{n} must be on the device of {first_name} ({device}), got {t.device}")
    return device


def dim_equal(what: str, name: str, got: int, ref_name: str, expected: int) -> None:
    if got != expected:
        raise ValueError(f"{name} {what} must equal {ref_name}'s ({expected}), got {got}")


def shape_equal(name: str, x: torch.Tensor, expected: Tuple[int, ...], doc: str = "") -> None:
    if x.shape != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}{' ' + doc if doc else ''}, "
                         f"got {tuple(x.shape)}")


def heads_divide(name_many: str, many: int, name_few: str, few: int) -> None:
    if few <= 0 or many % few != 0:
        raise ValueError(f"{name_many} ({many}) must be a multiple of {name_few} ({few})")


def positive_dim(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def one_of(name: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


def number(name: str, value, low: Optional[float] = None, high: Optional[float] = None,
           high_inclusive: bool = True, doc: str = "", finite: bool = False) -> float:
    """``value`` is an int or float (not bool), never NaN, within [low, high] (or [low, high) when not
    ``high_inclusive``) and, with ``finite``, not +-inf. ``doc`` words the range in the error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    not_finite = value != value or value in (float("inf"), float("-inf"))
    bad = value != value or (finite and not_finite) or (low is not None and value < low) or (
        high is not None and (value > high if high_inclusive else value >= high))
    if bad:
        rng = doc or ("" if low is None and high is None else f"in [{low}, {high}{']' if high_inclusive else ')'}")
        if finite and not_finite:
            rng = "a finite number" + (f" {rng}" if rng else "")
        raise ValueError(f"{name} must be {rng or 'a number, not NaN'}, got {value}")
    return float(value)


def window(window_size) -> Tuple[int, int]:
    """window_size is a pair of ints, each >= -1 (-1: unbounded)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
            isinstance(w, int) and not isinstance(w, bool) for w in window_size):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if any(w < -1 for w in window_size):
        raise ValueError(f"window_size entries must be >= -1 (-1 means unbounded), got {tuple(window_size)}")
    return int(window_size[0]), int(window_size[1])


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# set while a caller runs operators on index tensors whose values it has checked itself (context parallelism:
# the per-rank cu_seqlens a plan derived from the checked global one), see :func:`values_checked`
_VALUES_CHECKED = contextvars.ContextVar("delta_attn_values_checked", default=False)


@contextlib.contextmanager
def values_checked():
    """Within the block, operators skip the value checks of index tensors (no host read): for callers that
    pass index tensors they built from values they checked (``delta_attn.distributed``'s plans)."""
    token = _VALUES_CHECKED.set(True)
    try:
        yield
    finally:
        _VALUES_CHECKED.reset(token)


def value_checks_enabled() -> bool:
    """Checks that read device values on the host (one sync per call): off while torch.compile
    traces, while a CUDA graph is being captured (a host read cannot be captured: the caller validates
    the indices it captures), inside :func:`values_checked`, or when the user sets
    DELTA_ATTN_SKIP_VALUE_CHECKS=1 to keep launches asynchronous."""
    # _tracing first: torch.compile does not trace ContextVar.get (and skips these checks anyway)
    return (not _tracing() and not _VALUES_CHECKED.get() and not _capturing()
            and not settings.skip_value_checks())


class PendingChecks:
    """The value checks of one call whose verdict is read after its kernels are enqueued (its outputs are all new
    tensors, so a call that raises has modified nothing it was given). :func:`log_decay` defers its check of a log
    decay here. Then, in order: inside :meth:`routing`, a range read made while choosing the backend may settle a
    check with g's maximum already on the host (:func:`decay_top_sink`); :meth:`start` enqueues every other check's
    reduction and its copy to the host on a side stream (:func:`_start_max_read`), before the call's kernels;
    :meth:`finish`, after them, waits for those copies alone and raises on a bad value. The kernels do not wait for
    the reduction (it runs beside them) and the host waits for the reduction alone, so its next work overlaps the
    kernels; a read after the kernels would wait for the kernels too. A call whose first kernel reads g whole and
    writes its maximum (``kernels_report``) starts no reduction: that kernel reports through
    :func:`decay_report_sink`, and the host waits for it alone while the call's later kernels run."""

    def __init__(self):
        self.decays: List[_DecayCheck] = []
        self.device_max: Optional[Callable[[torch.Tensor, Any], Optional[Callable[[], float]]]] = None

    @contextlib.contextmanager
    def routing(self):
        """The block that chooses the call's backend (a range read there reports by :func:`decay_top_sink`).
        Nothing is set without a deferred check (torch.compile, which does not trace ContextVar.set, defers none)."""
        if not self.decays:
            yield
            return
        token = _ROUTING.set(self)
        try:
            yield
        finally:
            _ROUTING.reset(token)

    def run(self, route: Callable[[], Callable[[Any], Any]], args: Any, device_max=None,
            kernels_report: bool = False) -> Any:
        """``route()(args)`` with the checks in their places: ``route`` (which chooses the backend) inside
        :meth:`routing`, then :meth:`start`, the chosen implementation, :meth:`finish`. ``device_max(g, stream)``:
        a reduction of the operators' layer that :meth:`start` enqueues instead of torch's ``amax`` where it returns
        a reader (``ops/_prepare.positive_max_on_gpu``: for calls whose kernels leave room on every SM).
        ``kernels_report``: the caller expects the implementation's kernels to report g's maximum
        (:func:`decay_report_sink`), so nothing is started before it; a check they leave unsettled is started by
        :meth:`finish`, after the kernels."""
        with self.routing():
            impl = route()
        self.device_max = device_max
        token = _REPORTING.set(self) if kernels_report and self.decays else None
        if token is None:
            self.start()
        try:
            out = impl(args)
        except BaseException:
            self.settle()               # the side stream's reads of g end before the caller may free g
            raise
        finally:
            if token is not None:
                _REPORTING.reset(token)
        self.finish()
        return out

    def start(self) -> None:
        """Each unsettled check's reduction and host copy, enqueued now (before the call's kernels)."""
        for d in self.decays:
            if d.top is None:
                d.top = _start_max_read(d.g, self.device_max)

    def finish(self) -> None:
        """Each deferred check's verdict (each raises on a bad value): the host read :meth:`start` enqueued, or
        the value :func:`decay_top_sink` reported."""
        self.start()                    # no-op for the checks already started or settled
        for d in self.decays:
            _decay_verdict(d.name, d.g, d.hint, d.top if isinstance(d.top, float) else d.top())

    def settle(self) -> None:
        """Waits for every started reduction, with no verdict (for a call that failed otherwise)."""
        for d in self.decays:
            if callable(d.top):
                d.top()


@dataclasses.dataclass
class _DecayCheck:
    name: str
    g: torch.Tensor
    hint: str
    top: Union[float, Callable[[], float], None] = None   # g.max(): on the host, or a started host read


_ROUTING: contextvars.ContextVar[Optional[PendingChecks]] = contextvars.ContextVar("delta_attn_routing", default=None)
_REPORTING: contextvars.ContextVar[Optional[PendingChecks]] = contextvars.ContextVar("delta_attn_reporting",
                                                                                     default=None)


def decay_top_sink(g: torch.Tensor) -> Optional[Callable[[float], None]]:
    """For a backend's range read of the log decay ``g`` (the very tensor the call was given) made while the call
    is routed: where that call has deferred the check of ``g`` (:class:`PendingChecks`), a function to call with
    g's maximum read on the host (NaN when g holds one); the check then reads g no more. None where no such check
    is pending (value checks off, another tensor, already reported)."""
    checks = _ROUTING.get()
    for d in checks.decays if checks is not None else ():
        if d.g is g and d.top is None:
            return lambda top: setattr(d, "top", float(top))
    return None


def decay_report_sink(g: torch.Tensor) -> Optional[Callable[[Callable[[], float]], None]]:
    """For a kernel that reads the whole log decay ``g`` of a call that expects its kernels to report
    (:meth:`PendingChecks.run`'s ``kernels_report``) and writes max(0, g) with NaN read as 0 (the verdict's input):
    a function to call with the reader of that maximum (a host wait for its copy alone); the check then reads g no
    more. None where no such check is pending (another call, another tensor, already settled). ``g`` may be the
    call's tensor or one sharing its storage, shape and dtype (the operator's launcher sees g through its
    ``torch.library`` op)."""
    checks = _REPORTING.get()
    for d in checks.decays if checks is not None else ():
        if d.top is None and _same_values(d.g, g):
            return lambda read: setattr(d, "top", read)
    return None


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)


def _start_max_read(x: torch.Tensor, device_max=None) -> Callable[[], float]:
    """A function returning ``x.amax().item()``, or max(0, x) with NaN read as 0 where ``device_max`` (see
    :meth:`PendingChecks.run`) reads x: the same verdict of :func:`_decay_verdict`. On CUDA the reduction and its
    copy to pinned memory run on a high-priority side stream that first waits for the work enqueued so far on the
    current one (x's producers); work enqueued after it on the current stream does not wait for it, and the
    function waits for the copy's event alone. The caller keeps x alive until it has called the function."""
    if x.device.type != "cuda":
        value = x.detach().amax().item()
        return lambda: value
    side = _side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    read = device_max(x.detach(), side) if device_max is not None else None
    if read is not None:
        return read
    with torch.cuda.stream(side):
        top = x.detach().amax()     # no autograd node on this stream (x's AccumulateGrad would run on it)
        host = torch.empty((), dtype=top.dtype, pin_memory=True)
        host.copy_(top, non_blocking=True)
        read = torch.cuda.Event()
        read.record(side)
    return lambda: (read.synchronize(), host.item())[1]


_SIDE_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The device's stream for the value checks' reductions; high priority, so that its blocks are scheduled ahead
    of the kernels' as SMs free up and the host's wait stays short."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return _SIDE_STREAMS[device]


def log_decay(name: str, g: torch.Tensor, hint: str = "", pending: Optional[PendingChecks] = None) -> None:
    """A log decay is <= 0: the state is multiplied by ``exp(g)`` in [0, 1] (``-inf`` resets it). A positive entry
    (a state that grows, which the chunked kernels' ``exp(G_i - G_j)`` arithmetic assumes never happens) is a
    ``ValueError`` naming ``name``; ``hint`` says what to pass instead. NaN is not refused: it keeps its documented
    meaning (that sequence's outputs and state become NaN, the others are untouched). One reduction on the device
    and one host read, when :func:`value_checks_enabled` (never under CUDA-graph capture or torch.compile tracing,
    nor with DELTA_ATTN_SKIP_VALUE_CHECKS=1: the caller then keeps g <= 0). With ``pending`` (calls whose outputs
    are all new tensors) its reduction is enqueued at ``pending.start()``, before the call's kernels, and read at
    ``pending.finish()``, after them: the call still raises before it returns."""
    if g.numel() == 0 or not value_checks_enabled():
        return
    if pending is None:
        _decay_verdict(name, g, hint, g.amax().item())
    else:
        pending.decays.append(_DecayCheck(name, g, hint))


def _decay_verdict(name: str, g: torch.Tensor, hint: str, top: float) -> None:
    if top != top:          # a NaN entry hides the maximum of the others (rare: a second pass)
        top = g.nan_to_num(nan=0.0, posinf=float("inf")).amax().item()
    if top > 0:
        raise ValueError(f"{name} is a log decay and must be <= 0 (the state is multiplied by exp({name}) <= 1 at "
                         f"each token), got a value of {top:g}" + (f"; {hint}" if hint else ""))


INT32_MAX = 2 ** 31 - 1


def cu_seqlens_meta(name: str, cu: torch.Tensor, device: torch.device) -> int:
    """cu_seqlens is an int32 or int64 1-D tensor with >= 2 entries on ``device``. Returns the
    sequence count. (Any stride: :func:`as_int32` gives the kernels their contiguous int32 copy.)"""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 or int64 torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be {_dtype_names(INDEX_DTYPES)}, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries (batch + 1), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the device of the inputs ({device}), got {cu.device}")
    return cu.numel() - 1


def cu_seqlens_values(name: str, values: List[int], total: int, max_seqlen: Optional[int] = None,
                      max_seqlen_name: str = "max_seqlen") -> None:
    """The host copy of cu_seqlens fits int32, starts at 0, is non-decreasing, ends at ``total``, and
    ``max_seqlen`` (when given) is >= the longest sequence."""
    outside = [x for x in values if not -INT32_MAX - 1 <= x <= INT32_MAX]
    if outside:
        raise ValueError(f"{name} values must fit int32 (at most {INT32_MAX}): the kernels read int32 "
                         f"offsets, got {outside[0]}")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"{name}[-1] must equal the number of packed tokens ({total}), got {values[-1]}")
    if max_seqlen is not None and max_seqlen < max(lengths):
        raise ValueError(f"{max_seqlen_name} must be >= the longest sequence in {name} ({max(lengths)}), "
                         f"got {max_seqlen}")


def as_int32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The form every backend receives an index tensor in (``cu_seqlens``, ``state_indices``, chunk tables):
    contiguous int32, ``t`` itself when it already is. Call after the values are checked (an int64 value
    beyond int32 would wrap). The launch layer prepares index tensors with it (``ops._prepare.index``)."""
    return None if t is None else t.to(torch.int32).contiguous()


def max_seqlen(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def cu_seqlens(name: str, cu: torch.Tensor, total: int, device: torch.device) -> Tuple[torch.Tensor, int]:
    """Every check of one cu_seqlens (linear ops). Returns ``(cu as contiguous int32, number of sequences)``."""
    n = cu_seqlens_meta(name, cu, device)
    if value_checks_enabled():
        cu_seqlens_values(name, cu.tolist(), total)
    return as_int32(cu), n


def cu_seqlens_pair(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q, max_k,
                    device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Every check of flash varlen's ``cu_seqlens_q`` / ``cu_seqlens_k`` / ``max_seqlen_q`` / ``max_seqlen_k``
    (one device-to-host copy for both). Returns ``(cu_q, cu_k, N)`` as contiguous int32; one tensor passed
    for both stays one tensor (backends take ``cu_q is cu_k`` to mean equal lengths)."""
    n = cu_seqlens_meta("cu_seqlens_q", cu_q, device)
    n_k = cu_seqlens_meta("cu_seqlens_k", cu_k, device)
    max_seqlen("max_seqlen_q", max_q)
    max_seqlen("max_seqlen_k", max_k)
    if n_k != n:
        raise ValueError(f"cu_seqlens_k must describe as many sequences as cu_seqlens_q ({n}), got {n_k}")
    if value_checks_enabled():
        values = torch.cat([cu_q, cu_k]).tolist()     # one device-to-host copy (int32 + int64 promotes)
        cu_seqlens_values("cu_seqlens_q", values[:n + 1], total_q, max_q, "max_seqlen_q")
        cu_seqlens_values("cu_seqlens_k", values[n + 1:], total_k, max_k, "max_seqlen_k")
    same = cu_k is cu_q
    cu_q = as_int32(cu_q)
    return cu_q, (cu_q if same else as_int32(cu_k)), n


def state(name: str, s: Optional[torch.Tensor], expected: Tuple[int, ...], device: torch.device,
          doc: str) -> None:
    if s is None:
        return
    tensor(name, s, len(expected), ACCUMULATION_DTYPES, doc)
    shape_equal(name, s, expected, doc)
    if s.device != device:
        raise ValueError(f"{name} must be on the device of the inputs ({device}), got {s.device}")


def state_indices(indices: Optional[torch.Tensor], batch: int, pool: int, device: torch.device,
                  tokens: Optional[int] = None, num_accepted: Optional[torch.Tensor] = None,
                  values: bool = True) -> None:
    """The slots of a decode step: ``indices`` None (slot b is ``state[b]``), (B,) (sequence b reads and
    writes one slot) or, for speculative decoding, (B, T) with T == ``tokens`` (the state after token t of
    sequence b goes to slot ``indices[b, t]``; the step starts from ``indices[b, num_accepted[b] - 1]``).
    ``num_accepted`` (B,) needs (B, T) indices. Shapes, dtypes and devices are checked here; the values
    by :func:`state_indices_values` when :func:`value_checks_enabled` (never under CUDA-graph capture); with
    ``values=False`` the caller runs :func:`state_indices_value_checks` itself."""
    if indices is None:
        if num_accepted is not None:
            raise ValueError("num_accepted_tokens needs state_indices of shape (B, T): one slot per new token")
        if pool != batch:
            raise ValueError(f"state must have one slot per sequence (batch {batch}) when state_indices "
                             f"is None, got {pool} slots")
        return
    tensor("state_indices", indices, None, INDEX_DTYPES, "(B,) or (B, T)")
    if indices.dim() == 2 and tokens is not None:
        shape_equal("state_indices", indices, (batch, tokens), "(B, T): one slot per new token")
    elif indices.dim() != 1 or indices.shape[0] != batch:
        raise ValueError(f"state_indices must have shape ({batch},) (one slot per sequence)"
                         f"{f' or ({batch}, {tokens}) (one slot per new token)' if tokens is not None else ''}, "
                         f"got {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"state_indices must be on the device of the inputs ({device}), got {indices.device}")
    if num_accepted is not None:
        if indices.dim() != 2:
            raise ValueError("num_accepted_tokens needs state_indices of shape (B, T): one slot per new token, "
                             f"got shape {tuple(indices.shape)}")
        tensor("num_accepted_tokens", num_accepted, 1, INDEX_DTYPES, "(B,)")
        shape_equal("num_accepted_tokens", num_accepted, (batch,), "(one count per sequence)")
        if num_accepted.device != device:
            raise ValueError(f"num_accepted_tokens must be on the device of the inputs ({device}), "
                             f"got {num_accepted.device}")
    if values:
        state_indices_value_checks(indices, pool, num_accepted)


def decode_step(q: torch.Tensor, state: torch.Tensor, per_slot: Tuple[int, ...], doc: str,
                indices: Optional[torch.Tensor], num_accepted: Optional[torch.Tensor]) -> None:
    """The checks every decode step shares that read no device value: q (B, T, ...) with T >= 1 new tokens, the
    float32 (or float64) state pool (P, *per_slot) on q's device (``doc`` names its axes), and the slots
    (:func:`state_indices`; their values: :func:`state_indices_value_checks`, on every call)."""
    b, t = q.shape[0], q.shape[1]
    positive_dim("new tokens per sequence (q.shape[1])", t)
    tensor("state", state, 1 + len(per_slot), ACCUMULATION_DTYPES, f"{doc} float32 state pool")
    shape_equal("state", state, (state.shape[0], *per_slot), doc)
    if state.device != q.device:
        raise ValueError(f"state must be on the device of the inputs ({q.device}), got {state.device}")
    state_indices(indices, b, state.shape[0], q.device, t, num_accepted, values=False)


def state_indices_value_checks(indices: Optional[torch.Tensor], pool: int,
                               num_accepted: Optional[torch.Tensor] = None) -> None:
    """The value part of :func:`state_indices` (after its shape checks), when :func:`value_checks_enabled`."""
    if indices is not None and value_checks_enabled() and indices.numel() > 0:
        state_indices_values(indices, pool, num_accepted)


def state_indices_values(indices: torch.Tensor, pool: int, num_accepted: Optional[torch.Tensor] = None) -> None:
    """The values of ``state_indices`` lie in [0, pool) and never repeat (two writes to one slot); those of
    ``num_accepted_tokens`` in [1, T]. One device-to-host copy (a sync: never called under capture)."""
    flat = indices.reshape(-1)
    ordered = flat.sort().values
    stats = [ordered[0], ordered[-1], (ordered[1:] == ordered[:-1]).any().to(ordered.dtype)]
    if num_accepted is not None:
        stats += [num_accepted.min().to(ordered.dtype), num_accepted.max().to(ordered.dtype)]
    values = torch.stack(stats).tolist()
    lo, hi, repeats = values[:3]
    if lo < 0 or hi >= pool:
        raise ValueError(f"state_indices must lie in [0, {pool}) (the state pool), got values from {lo} to {hi}")
    if repeats:
        raise ValueError("state_indices must not repeat a slot: two sequences (or tokens) would write one state")
    if num_accepted is not None:
        tokens = indices.shape[1]
        if values[3] < 1 or values[4] > tokens:
            raise ValueError(f"num_accepted_tokens must lie in [1, {tokens}] (T, the tokens per sequence), "
                             f"got values from {values[3]} to {values[4]}")


def unknown_keywords(fn: str, got: Dict[str, Any], theirs: Dict[str, str]) -> None:
    """``got``: keywords that ``fn`` does not take. A TypeError naming the first; where it is another library's
    keyword (``theirs``: their name -> what to pass to delta-attn instead), the error says what to pass."""
    for name in got:
        if name in theirs:
            raise TypeError(f"{fn}() got {name}=, a keyword of FLA's KDA: {theirs[name]} (docs/MIGRATION.md lists "
                            "every FLA keyword)")
        raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value
