"""The rows a benchmark run records: :class:`BenchRow` (one per implementation, case and direction of a suite,
built by bench/runner.py) and :class:`ScalingRow` (``bench scaling``, bench/scaling.py).

``to_json()`` is the row as results.jsonl holds it (``"record": "row"`` first, then the fields in their
order; docs/BENCH.md's schema). The reports, the CSV and ``delta-attn report DIR`` read that form back, so
results recorded before these classes existed render the same.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional


def _json(row) -> Dict[str, Any]:
    """``{"record": "row", field: value, ...}`` in field order; values are shared, not copied."""
    out: Dict[str, Any] = {"record": "row"}
    out.update((f.name, getattr(row, f.name)) for f in fields(row))
    return out


@dataclass
class BenchRow:
    """One (implementation, case, direction) of a suite. A row that did not run (``status`` other than
    ``"ok"``) carries no time and says why in ``note``; the correctness gate's verdict is ``gate``."""

    suite: str
    op: str
    impl: str
    provider: str                        # the package the implementation comes from ("delta-attn", "fla-core", ...)
    family: str                          # "quadratic" (attention) or "linear"
    direction: str                       # "fwd", "bwd" or "fwd+bwd"
    dtype: str                           # "bf16", "fp16", "fp32"
    label: str                           # the case as the report prints it (cases.label)
    case: Dict[str, Any]                 # the case's sizes (op left out)
    tokens: int
    status: str                          # "ok", "FAILED", "skipped" or "unavailable"
    note: str
    elapsed_s: float                     # when the row ended, from the start of the run
    # the timer (ms): median, mean, std, p20, p80, min over `reps` timed calls
    ms: Optional[float] = None
    ms_mean: Optional[float] = None
    ms_std: Optional[float] = None
    ms_p20: Optional[float] = None
    ms_p80: Optional[float] = None
    ms_min: Optional[float] = None
    reps: Optional[int] = None
    first_call_ms: Optional[float] = None     # compilation and autotuning, not in the timed medians
    # the FLOP and byte models against the run's ceilings
    flops: Optional[float] = None
    tflops: Optional[float] = None
    frac_gemm: Optional[float] = None
    bytes: Optional[float] = None
    gbps: Optional[float] = None
    frac_copy: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_mem_mb: Optional[float] = None
    graph_ms: Optional[float] = None          # decode rows on a GPU: the CUDA-graph replay's median
    graph_note: str = ""                      # or why the step could not be captured
    gate: Optional[Dict[str, Any]] = None     # {ok, message, max_error, bound}
    # the resource report of the first call (bench/resources.py), set when the row is emitted
    kernels: Optional[List[Dict[str, Any]]] = None
    kernels_note: Optional[str] = None
    resources: Optional[Dict[str, Any]] = None
    roofline: Optional[Dict[str, Any]] = None

    def to_json(self) -> Dict[str, Any]:
        return _json(self)


@dataclass
class ScalingRow:
    """One (operator, weak / strong mode, state-passing scheme, dtype, direction) of ``bench scaling`` on
    ``world`` ranks; the measurements are bench/scaling.py's (its docstring defines each)."""

    suite: str
    op: str
    mode: str                                 # "weak" or "strong"
    world: int
    state_passing: Optional[str]              # "allgather" / "ring"; None for attention
    dtype: str
    direction: str
    tokens_total: int
    tokens_per_gpu: Optional[int]
    H: int
    D: int
    status: str
    note: str
    ms: Optional[float] = None
    ms_min: Optional[float] = None
    reps: Optional[int] = None
    local_ms: Optional[float] = None
    peak_mib: Optional[float] = None
    local_peak_mib: Optional[float] = None
    comm_ms: Optional[float] = None
    one_gpu_ms: Optional[float] = None
    ideal_ms: Optional[float] = None
    ideal_source: Optional[str] = None
    mem_ratio: Optional[float] = None
    tokens_per_s: Optional[float] = None
    one_gpu_tokens_per_s: Optional[float] = None
    efficiency: Optional[float] = None
    efficiency_vs_ideal: Optional[float] = None

    def to_json(self) -> Dict[str, Any]:
        return _json(self)
