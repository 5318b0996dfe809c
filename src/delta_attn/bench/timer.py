"""The timing protocol (docs/BENCH.md): warm-up, L2 flushed before every repeat, CUDA events, median.

``measure(fn)`` is a small ``do_bench``: one call estimates the cost, enough calls follow to fill
``warmup_ms`` (none for a call slower than that: the estimate call warmed it), then ``reps`` timed calls
(``rep_ms`` worth, clamped to [min_reps, max_reps]); before each timed call the L2 cache is flushed by writing
a buffer larger than it and ``before()`` runs (e.g. dropping ``.grad``), neither inside the events. On a CPU
device the clock is ``time.perf_counter`` and nothing is flushed.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch

_FLUSH: dict = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer well above the L2 size (50 MiB on the H200): 256 MiB of int8."""
    key = str(device)
    if key not in _FLUSH:
        _FLUSH[key] = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=device)
    return _FLUSH[key]


@dataclass
class Timing:
    median_ms: float
    mean_ms: float
    std_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    reps: int

    def as_dict(self) -> dict:
        return asdict(self)


def _quantile(xs: List[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(times: List[float]) -> Timing:
    return Timing(median_ms=statistics.median(times), mean_ms=statistics.fmean(times),
                  std_ms=statistics.pstdev(times) if len(times) > 1 else 0.0,
                  p20_ms=_quantile(times, 0.2), p80_ms=_quantile(times, 0.8), min_ms=min(times), reps=len(times))


class _Clock:
    """One interval measured with CUDA events (GPU) or perf_counter (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            return (s, e)
        return time.perf_counter()

    def stop(self, token):
        if self.cuda:
            token[1].record()
            return token
        return (time.perf_counter() - token) * 1e3

    def read(self, tokens) -> List[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in tokens]
        return list(tokens)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def estimate_ms(fn: Callable[[], object], device: torch.device, before: Optional[Callable[[], None]] = None,
                calls: int = 1) -> float:
    """Mean time of ``calls`` back-to-back calls (no flush): the cost estimate for planning."""
    clock = _Clock(device)
    clock.sync()
    if before is not None:
        before()
    tok = clock.start()
    for _ in range(calls):
        fn()
    return clock.read([clock.stop(tok)])[0] / calls


def measure(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25.0, rep_ms: float = 100.0,
            min_reps: int = 3, max_reps: int = 100, before: Optional[Callable[[], None]] = None,
            estimate: Optional[float] = None) -> Timing:
    """Time ``fn`` per the protocol; ``fn`` must already have run once (compiled, autotuned)."""
    clock = _Clock(device)
    if estimate is None and (warmup_ms > 0 or rep_ms > 0):
        estimate = estimate_ms(fn, device, before)
    est = max(estimate or 0.0, 1e-3)
    flush = _flush_buffer(device) if device.type == "cuda" else None
    # warm-up: calls filling warmup_ms; the estimate call (and the untimed first call before it) already
    # warmed up a call slower than warmup_ms
    for _ in range(0 if warmup_ms <= 0 else min(50, int(warmup_ms / est))):
        if before is not None:
            before()
        fn()
    reps = max(min_reps, min(max_reps, int(rep_ms / est)))
    tokens = []
    for _ in range(reps):
        if before is not None:
            before()
        if flush is not None:
            flush.zero_()
        tok = clock.start()
        fn()
        tokens.append(clock.stop(tok))
    return summarize(clock.read(tokens))


def measure_graph(fn: Callable[[], object], device: torch.device, *, warm_calls: int = 1, **kw) -> Timing:
    """``fn`` captured once in a CUDA graph and its replays timed by :func:`measure` (``kw``): how servers run
    a decode step, with no host launch cost. ``warm_calls`` calls run first on a side stream (compilation,
    allocator), as ``torch.cuda.graphs`` asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm_calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return measure(graph.replay, device, **kw)
