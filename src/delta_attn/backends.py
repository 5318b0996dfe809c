"""Backend registry and dispatch.

A *backend* (``torch``, ``triton``, ``cudnn``, ``sdpa``) declares, for each operator it implements,
a :class:`Capability`: device types, dtypes, head dims, optional features, minimum compute
capability and the Python package it needs. A backend whose kernels differ per device declares one
capability per device type for an operator (``register(..., device_type="cpu")``: ``sdpa`` runs
PyTorch's FlashAttention-2 / memory-efficient kernels on CUDA and its CPU flash kernel on CPU).
:meth:`Backend.not_supported_reasons` turns a :class:`Call` (what one call of an operator asks
for) into readable reasons.

Dispatch: an explicit backend runs the call or raises :class:`UnsupportedError` listing all its
reasons; ``"auto"`` walks the operator's policy order (:func:`auto_order`) and takes the first
backend with no reasons. :func:`explain_call` reports the choice and why every other backend was
passed over. Implementations are named as ``"module:function"`` strings and imported on first use,
so ``import delta_attn`` compiles no kernel and imports no optional package.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from . import settings

BACKEND_NAMES = ("auto", "triton", "cudnn", "sdpa", "torch")

# every operator name the registry knows
OPS = ("flash", "flash_varlen", "flash_kvcache", "kda", "kda_step", "diag", "diag_step")


class UnsupportedError(ValueError, NotImplementedError):
    """The requested backend (or every backend, for ``auto``) cannot run this call."""


class ReferenceFallbackWarning(UserWarning):
    """``auto`` resolved to the plain-PyTorch reference path on a GPU (slow but correct)."""


@dataclass(frozen=True)
class Call:
    """What one operator call needs from a backend."""
    op: str
    device: torch.device
    dtype: torch.dtype
    head_dims: Tuple[int, ...]
    features: FrozenSet[str] = frozenset()
    needs_grad: bool = False
    compiling: bool = False          # traced by torch.compile: the backend must be traceable
    seqlen: int = 0                  # tokens per sequence of a dense call, rounded up to a power of two (0: packed)

    def describe(self) -> str:
        feats = ", ".join(sorted(self.features)) or "no options"
        grad = " + backward" if self.needs_grad else ""
        dims = "x".join(str(d) for d in self.head_dims)
        traced = " under torch.compile" if self.compiling else ""
        return (f"{self.op}{grad} on {self.device.type}{traced}, {str(self.dtype).replace('torch.', '')}, "
                f"head dims {dims}, {feats}")


def recurrent_features(cu_seqlens, initial_state, output_final_state: bool, state_indices) -> set:
    """The Call features shared by the recurrent operators (kda, diag and their decode steps)."""
    named = {"varlen": cu_seqlens is not None, "initial_state": initial_state is not None,
             "final_state": output_final_state, "state_indices": state_indices is not None,
             "speculative": state_indices is not None and state_indices.dim() == 2}
    return {name for name, used in named.items() if used}


@dataclass(frozen=True)
class Capability:
    """What one backend supports for one operator."""
    impl: str                                   # "module:function", imported on first use
    device_types: Tuple[str, ...] = ("cuda",)
    dtypes: Tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    features: FrozenSet[str] = frozenset()      # optional features it supports
    backward: bool = True
    min_compute_capability: Optional[Tuple[int, int]] = None
    requires: Tuple[str, ...] = ()              # importable module names
    install_hint: str = ""
    head_dims: Optional[Callable[[Tuple[int, ...]], Optional[str]]] = None   # -> reason or None
    check: Optional[Callable[[Call], List[str]]] = None                      # extra reasons
    traceable: bool = True                      # torch.compile can trace it (plain ops or custom ops)


def package_available(module: str) -> bool:
    """Whether ``module`` can be imported. A constant of the graph under torch.compile (importlib's lookup is a
    call dynamo refuses to trace): marked below, where ``trace_constant`` is defined."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def device_capability(device: torch.device) -> Optional[Tuple[int, int]]:
    """Compute capability of a CUDA device (None elsewhere). Tests monkeypatch this."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


# Triton's CPU interpreter is on (TRITON_INTERPRET, read in settings.py)
triton_interpreter_on = settings.triton_interpreter


@lru_cache(maxsize=None)
def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


class Backend:
    def __init__(self, name: str, description: str, device_rule: Optional[Callable[[Call], List[str]]] = None):
        self.name = name
        self.description = description
        self.capabilities: Dict[str, Capability] = {}
        # (op, device type) -> the capability for calls on that device type, in place of capabilities[op]
        self.device_capabilities: Dict[Tuple[str, str], Capability] = {}
        self._device_rule = device_rule
        self._loaded: Dict[str, Callable] = {}
        # the same functions as attributes, read by select(): torch.compile snapshots a dict when the
        # trace first touches it (an implementation imported later in the same trace is then
        # missing), whereas it reads an object's attribute when asked
        self.loaded = types.SimpleNamespace()

    def register(self, op: str, capability: Capability, device_type: Optional[str] = None) -> None:
        """Declare ``capability`` for ``op``; with ``device_type``, for calls on that device type only
        (it replaces the general capability there). Every capability of one operator names the same
        implementation, which dispatches on the device itself."""
        if op not in OPS:
            raise ValueError(f"unknown operator {op!r}; known: {', '.join(OPS)}")
        if device_type is not None and device_type not in capability.device_types:
            raise ValueError(f"a capability registered for {device_type} tensors must list {device_type!r} "
                             f"in device_types, got {capability.device_types}")
        others = [c.impl for (o, d), c in self.device_capabilities.items() if o == op and d != device_type]
        if device_type is not None and op in self.capabilities:
            others.append(self.capabilities[op].impl)
        if any(impl != capability.impl for impl in others):
            raise ValueError(f"{self.name}/{op}: every capability of one operator names the same implementation "
                             f"(it dispatches on the device), got {capability.impl} and "
                             f"{', '.join(sorted(set(others)))}")
        if device_type is None:
            self.capabilities[op] = capability
        else:
            self.device_capabilities[(op, device_type)] = capability
        clear_dispatch_cache()
        self._loaded.pop(op, None)
        self.loaded.__dict__.pop(op, None)

    def capability(self, op: str, device_type: str) -> Optional[Capability]:
        """The capability that governs calls of ``op`` on ``device_type`` tensors (None: not implemented)."""
        return self.device_capabilities.get((op, device_type), self.capabilities.get(op))

    def device_types(self, op: str) -> Tuple[str, ...]:
        """Every device type some capability of ``op`` accepts, in declaration order."""
        caps = ([self.capabilities[op]] if op in self.capabilities else []) + \
            [c for (o, _), c in self.device_capabilities.items() if o == op]
        return tuple(dict.fromkeys(d for c in caps for d in c.device_types))

    def not_supported_reasons(self, call: Call) -> List[str]:
        cap = self.capability(call.op, call.device.type)
        if cap is None:
            return [f"has no implementation of {call.op}"]
        reasons: List[str] = []
        missing = [m for m in cap.requires if not package_available(m)]
        if missing:
            hint = f" — {cap.install_hint}" if cap.install_hint else ""
            reasons.append(f"{', '.join(missing)} not installed{hint}")
        if self._device_rule is not None:
            reasons += self._device_rule(call)
        elif call.device.type not in cap.device_types:
            reasons.append(f"runs on {'/'.join(self.device_types(call.op))} tensors, got {call.device.type}")
        if call.device.type == "cuda" and not torch.cuda.is_available():
            reasons.append("no CUDA GPU visible")
        if cap.min_compute_capability is not None and call.device.type == "cuda":
            cc = device_capability(call.device)
            if cc is not None and cc < cap.min_compute_capability:
                want = ".".join(map(str, cap.min_compute_capability))
                reasons.append(f"needs compute capability >= {want}, device has {cc[0]}.{cc[1]}")
        if call.dtype not in cap.dtypes:
            reasons.append(f"supports {', '.join(_dtype_name(d) for d in cap.dtypes)}, got {_dtype_name(call.dtype)}")
        if cap.head_dims is not None:
            why = cap.head_dims(call.head_dims)
            if why:
                reasons.append(why)
        unsupported = sorted(call.features - cap.features)
        if unsupported:
            reasons.append(f"does not support {', '.join(unsupported)}")
        if call.needs_grad and not cap.backward:
            reasons.append("has no backward pass (inputs require grad)")
        if call.compiling and not cap.traceable:
            reasons.append("cannot be traced by torch.compile")
        if cap.check is not None:
            reasons += cap.check(call)
        return reasons

    def implementation(self, op: str) -> Callable:
        fn = self._loaded.get(op)
        if fn is None:
            cap = self.capabilities.get(op) or next(c for (o, _), c in self.device_capabilities.items() if o == op)
            module, _, attr = cap.impl.partition(":")
            fn = getattr(importlib.import_module(module), attr)
            self._loaded[op] = fn
            setattr(self.loaded, op, fn)
        return fn


# bfloat16 under the Triton interpreter (TRITON_INTERPRET=1) is wrong for every Triton operator: tl.dot on
# bfloat16 operands returns garbage (seen on Triton 3.6, measured on 3.9.0) and float32 -> bfloat16 casts truncate
# instead of rounding (1 ulp off: the diagonal scans and the decode steps, which have no tl.dot, fail the error
# rule), so bfloat16 runs on CUDA GPUs only. tests/ops/test_backend_capabilities.py checks that the installed Triton
# still has the tl.dot bug.


def _triton_device_rule(call: Call) -> List[str]:
    if call.device.type == "cuda":
        return []
    if call.device.type == "cpu" and triton_interpreter_on():
        if call.dtype == torch.bfloat16:
            return [f"the Triton interpreter (TRITON_INTERPRET=1, Triton {_triton_version()}) computes bfloat16 "
                    f"wrongly (tl.dot on bfloat16 operands, truncating float32 -> bfloat16 casts), so bfloat16 "
                    f"{call.op} runs on CUDA GPUs only (use float16 or float32 on CPU)"]
        return []
    return [f"runs on cuda tensors (or cpu tensors with TRITON_INTERPRET=1), got {call.device.type}"]


BACKENDS: Dict[str, Backend] = {
    "torch": Backend("torch", "the reference path in plain PyTorch (any device, autograd; slow)"),
    "triton": Backend("triton", "delta-attn's Triton kernels", device_rule=_triton_device_rule),
    "cudnn": Backend("cudnn", "NVIDIA cuDNN fused attention (SDPA's cuDNN backend, cudnn-frontend graphs)"),
    "sdpa": Backend("sdpa", "PyTorch's own fused kernels (SDPA flash / memory-efficient, varlen_attn)"),
}


def register(backend: str, op: str, capability: Capability, device_type: Optional[str] = None) -> None:
    """Declare that ``backend`` implements ``op`` with ``capability`` (on ``device_type`` tensors only, if given)."""
    BACKENDS[backend].register(op, capability, device_type)


# ---------------------------------------------------------------------------------------------
# auto policy
# ---------------------------------------------------------------------------------------------

# Default preference per operator, fastest first. The measurements behind each order are in
# docs/DISPATCH.md; an operator may install a finer policy with set_auto_policy. The attention policy
# (attention_policy, below) orders CUDA calls by its measurements and takes this order for the others (CPU
# tensors): PyTorch SDPA's CPU kernel first (forward 4.0-17.5x faster than the reference at S = 256-2048,
# DISPATCH.md), the Triton kernels next (CPU tensors only under TRITON_INTERPRET=1, the test mode), the
# reference last.
_DEFAULT_ORDER: Dict[str, Tuple[str, ...]] = {
    "flash": ("sdpa", "triton", "cudnn", "torch"),
    "flash_varlen": ("sdpa", "triton", "cudnn", "torch"),
    # KV-cache decode: the split-KV Triton kernel (graph-capturable), the reference (docs/DISPATCH.md)
    "flash_kvcache": ("triton", "torch"),
    "kda": ("triton", "torch"),
    "kda_step": ("triton", "torch"),
    "diag": ("triton", "torch"),
    "diag_step": ("triton", "torch"),
}

# The attention order on sm90+ per (operator, training): training = some input requires grad, so the backward
# follows and forward+backward time decides; otherwise the forward time decides (docs/DISPATCH.md).
ATTENTION_SM90_ORDER = {
    ("flash", False): ("cudnn", "triton", "sdpa", "torch"),
    ("flash", True): ("cudnn", "triton", "sdpa", "torch"),
    ("flash_varlen", False): ("cudnn", "triton", "sdpa", "torch"),
    ("flash_varlen", True): ("cudnn", "triton", "sdpa", "torch"),
}
ATTENTION_SM90_WHY = {
    ("flash", False): "dense forward: cuDNN fastest on every H200 benchmark shape",
    ("flash", True): "dense forward+backward: cuDNN fastest on every H200 benchmark shape",
    ("flash_varlen", False): "varlen forward: the cuDNN ragged graph is fastest on the H200 mixed batch",
    ("flash_varlen", True): "varlen forward+backward: the cuDNN ragged graphs are fastest on the H200 mixed batch",
}


def attention_policy(call: Call) -> Tuple[str, ...]:
    """``auto`` for ``flash`` / ``flash_varlen``: the measured order on sm90+, cuDNN first elsewhere on CUDA,
    the default order for other devices."""
    cc = device_capability(call.device) if call.device.type == "cuda" else None
    if cc is None:
        return _DEFAULT_ORDER[call.op]
    if cc >= (9, 0):
        return ATTENTION_SM90_ORDER[(call.op, call.needs_grad)]
    # Ampere / Ada: not measured by us; cuDNN and FA2 are close there, ours last among fused paths
    return ("cudnn", "sdpa", "triton", "torch")


def _attention_policy_note(call: Call) -> str:
    cc = device_capability(call.device) if call.device.type == "cuda" else None
    if cc is None:
        return "not a CUDA call: default order"
    if cc >= (9, 0):
        return f"sm90+, {ATTENTION_SM90_WHY[(call.op, call.needs_grad)]} (docs/DISPATCH.md)"
    return f"sm{cc[0]}{cc[1]}: cudnn > sdpa > triton (not measured on this architecture)"


attention_policy.describe = _attention_policy_note
# op -> policy(call) -> backend names, preferred first (set_auto_policy); operators without one use _DEFAULT_ORDER
_POLICIES: Dict[str, Callable[[Call], Sequence[str]]] = {"flash": attention_policy, "flash_varlen": attention_policy}
# what explain() says about the default order of an operator on CPU tensors
_CPU_WHY: Dict[str, str] = {
    op: "cpu: PyTorch SDPA's CPU kernel first (forward 4.0-17.5x faster than the reference at S = 256-2048, "
        "docs/DISPATCH.md), the Triton "
        "interpreter next, the reference where neither computes the call"
    for op in ("flash", "flash_varlen")}


def set_auto_policy(op: str, policy: Callable[[Call], Sequence[str]]) -> None:
    """Install ``policy(call) -> backend names, preferred first`` for ``op``."""
    _POLICIES[op] = policy
    clear_dispatch_cache()


def auto_order(call: Call) -> Tuple[str, ...]:
    policy = _POLICIES.get(call.op)
    order = tuple(policy(call)) if policy is not None else _DEFAULT_ORDER[call.op]
    # every registered backend appears once, unlisted ones last
    return order + tuple(n for n in BACKENDS if n not in order)


@dataclass
class Explanation:
    """Which backend a call uses and why the others were passed over."""
    call: Call
    requested: str
    chosen: Optional[str]
    considered: List[Tuple[str, List[str]]] = field(default_factory=list)   # (backend, reasons) in order
    policy_note: Optional[str] = None     # why the auto policy orders backends this way (policy.describe)

    def __str__(self) -> str:
        order = " (policy order: " + ", ".join(n for n, _ in self.considered) + ")" if self.requested == "auto" else ""
        lines = [f"{self.call.describe()}", f"requested backend: {self.requested}{order}"]
        if self.policy_note:
            lines.append(f"policy: {self.policy_note}")
        lines.append(f"chosen: {self.chosen}" if self.chosen else "chosen: none — no backend can run this call")
        for name, reasons in self.considered:
            if name == self.chosen:
                continue
            if reasons:
                lines.append(f"  {name}: passed over — " + "; ".join(reasons))
            elif self.chosen is not None and self.requested == "auto":
                lines.append(f"  {name}: could run it, lower in the policy order")
        return "\n".join(lines)


def _candidates(call: Call, backend: str) -> Tuple[str, ...]:
    """The backends ``backend`` lets run ``call``, in order: the policy order for ``auto``, else ``backend``."""
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKEND_NAMES)}, got {backend!r}")
    return auto_order(call) if backend == "auto" else (backend,)


def explain_call(call: Call, backend: str = "auto") -> Explanation:
    names = _candidates(call, backend)
    ex = Explanation(call=call, requested=backend, chosen=None)
    describe = getattr(_POLICIES.get(call.op), "describe", None) if backend == "auto" else None
    if describe is not None:
        ex.policy_note = describe(call)
    if backend == "auto" and call.device.type == "cpu" and call.op in _CPU_WHY:
        ex.policy_note = "; ".join(n for n in (ex.policy_note, _CPU_WHY[call.op]) if n)
    for name in names:
        reasons = BACKENDS[name].not_supported_reasons(call)
        ex.considered.append((name, reasons))
        if not reasons and ex.chosen is None:
            ex.chosen = name
    return ex


_warned: set = set()

# The choices made so far: (the arguments of _choose, the process state they depend on) -> backend name.
# A choice depends on the call and on the registry (capabilities, policies: register / set_auto_policy clear
# this), on TRITON_INTERPRET and on whether CUDA is visible (both in the key), and on what the checks probe once
# per process (installed packages, compute capability, cuDNN version). Only choices that raise nothing and warn
# nothing are kept; an eager decode call then pays one look-up instead of asking every backend (docs/DISPATCH.md).
_CHOSEN: Dict[tuple, str] = {}


def clear_dispatch_cache() -> None:
    """Forget every cached choice (after changing what the backends' checks read, e.g. in tests)."""
    _CHOSEN.clear()


def _choose(op: str, device: torch.device, dtype: torch.dtype, head_dims: Tuple[int, ...],
            features: Tuple[str, ...], needs_grad: bool, compiling: bool, seqlen: int, backend: str) -> str:
    """The backend that runs the call (imports its implementation now). Runs eagerly even while
    torch.compile traces, so dispatch never breaks a graph: the choice is a constant of the trace."""
    key = (op, device, dtype, head_dims, features, needs_grad, compiling, seqlen, backend, triton_interpreter_on(),
           torch.cuda.is_available())
    chosen = _CHOSEN.get(key)
    if chosen is not None:
        BACKENDS[chosen].implementation(op)
        return chosen
    call = Call(op, device, dtype, head_dims, frozenset(features), needs_grad, compiling, seqlen)
    # the first candidate with no reasons: what explain_call chooses, without asking the backends after it
    chosen = next((n for n in _candidates(call, backend) if not BACKENDS[n].not_supported_reasons(call)), None)
    warn_key = (call.op, call.dtype, call.head_dims, call.features)
    fallback = backend == "auto" and chosen == "torch" and call.device.type == "cuda" and warn_key not in _warned
    if chosen is not None and not fallback:
        BACKENDS[chosen].implementation(call.op)
        if len(_CHOSEN) >= 4096:      # bounded: shapes (head dims) are in the key
            _CHOSEN.clear()
        _CHOSEN[key] = chosen
        return chosen
    ex = explain_call(call, backend)      # the full explanation: for the error or the fallback warning
    if ex.chosen is None:
        if backend == "auto":
            detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in ex.considered)
            raise UnsupportedError(f"no backend can run {call.describe()} — {detail}")
        reasons = ex.considered[0][1]
        raise UnsupportedError(f"backend {backend!r} cannot run {call.describe()}: " + "; ".join(reasons))
    if backend == "auto" and ex.chosen == "torch" and call.device.type == "cuda":
        if warn_key not in _warned:
            _warned.add(warn_key)
            warnings.warn("delta_attn: auto runs the slow reference path for this call\n" + str(ex),
                          ReferenceFallbackWarning, stacklevel=4)
    BACKENDS[ex.chosen].implementation(call.op)
    return ex.chosen


def trace_constant(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result(fn)``: torch.compile treats ``fn``'s result as a constant of the
    graph (the backend choice is made once at trace time and never breaks a graph). The public decorator imports
    ``torch._dynamo``, and with it sympy, numpy and Triton (about 1.2 s), which ``import delta_attn`` must not do
    (tests/project/test_env.py); all it does is set the attribute below, so that is set here while dynamo is not loaded.
    tests/ops/test_backends.py checks against the installed torch that the public decorator sets exactly this."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


_choose = trace_constant(_choose)
package_available = trace_constant(package_available)


def select(call: Call, backend: str = "auto") -> Callable:
    """The implementation that runs ``call`` on ``backend`` (or raises UnsupportedError)."""
    name = _choose(call.op, call.device, call.dtype, tuple(call.head_dims), tuple(sorted(call.features)),
                   call.needs_grad, torch.compiler.is_compiling(), call.seqlen, backend)
    return getattr(BACKENDS[name].loaded, call.op)
