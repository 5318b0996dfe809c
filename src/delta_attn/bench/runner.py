"""Runs a suite's tasks: availability, time budget, correctness gate, timing, metrics, one row each."""
from __future__ import annotations

import contextlib
import functools
import gc
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import cases, models
from .gate import GateResult, gate_key, is_unavailable_error, run_gate
from .impls import Impl
from .rows import BenchRow
from .timer import _flush_buffer, estimate_ms, measure, measure_graph
from . import resources as _resources   # per-kernel resource report

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass
class Settings:
    device: str = "cuda"
    tiny: bool = False
    quick: bool = False
    dtypes: Tuple[str, ...] = ("bf16",)
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_reps: int = 3
    max_reps: int = 100
    max_call_ms: float = 2500.0      # a row whose predicted single call exceeds this is skipped
    seed: int = 0
    impls: Tuple[str, ...] = ()      # substrings; empty = all
    ops: Tuple[str, ...] = ()        # kernels suite: only these operators (kda, flash, ...); empty = all
    directions: Tuple[str, ...] = ()  # empty = the suite's default
    tokens: int = 65536
    heads: int = 16
    head_dim: int = 128
    max_seq: int = 131072
    max_linear_seq: int = 1048576
    gate: bool = True
    resources: str = "auto"          # auto (kernels suite: Triton launches) | off | triton | full
    time_budget_s: float = 0.0       # > 0: rows not started by then are skipped (the suite ends in time)
    # > 0: a row (its first call: compilation, autotuning) is stopped after this many seconds, and so is
    # any row still running when the time budget ends; the implementation's later rows in that direction
    # are skipped. Bounds a peer whose autotuning would otherwise starve every other row.
    first_call_limit_s: float = 0.0
    graphs: bool = True              # decode rows on a GPU are also timed as CUDA-graph replays
    # backward rows: "accumulate" = from the second call on the gradients add into the leaves' .grad
    # (triton.testing.do_bench's default, the protocol of docs/PEERS.md: measured to reproduce its FLA
    # figures within 2 %, docs/PERFORMANCE.md); "fresh" = .grad reset to
    # None before every call (outside the timed region): the backward kernels alone
    grads: str = "accumulate"

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Refuse settings that would silently mean something else (run again by run_suite, since the
        CLI sets some fields after construction)."""
        if self.grads not in ("accumulate", "fresh"):
            raise ValueError(f"grads must be 'accumulate' or 'fresh', got {self.grads!r}")
        if self.resources not in ("auto", "off", "triton", "full"):
            raise ValueError(f"resources must be 'auto', 'off', 'triton' or 'full', got {self.resources!r}")
        for name in ("time_budget_s", "first_call_limit_s", "warmup_ms", "rep_ms"):
            value = getattr(self, name)
            if not value >= 0:          # also refuses NaN
                raise ValueError(f"{name} must be >= 0 (0 = none), got {value!r}")

    def as_dict(self) -> Dict:
        return asdict(self)


@dataclass
class Task:
    suite: str
    case: Dict
    impl: Impl
    directions: Sequence[str]
    dtype: torch.dtype
    series: str = ""                  # rows of one series predict each other's time (budget rule)


class RowTimeout(BaseException):
    """Raised (from SIGALRM) in a row that ran past its limit. A BaseException, so that no library's
    ``except Exception`` around its autotuning swallows it."""


@contextlib.contextmanager
def time_limit(seconds: Optional[float]):
    """Raise :class:`RowTimeout` in the block after ``seconds`` of wall clock (None / <= 0: no limit).
    SIGALRM only exists on POSIX main threads; elsewhere the block runs unbounded."""
    usable = (seconds is not None and seconds > 0 and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise RowTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Progress:
    """tqdm bar on a terminal; one line per row otherwise (logs)."""

    def __init__(self, total: int, desc: str):
        self.bar = None
        self.n, self.total = 0, total
        if sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=total, desc=desc, unit="row", dynamic_ncols=True, leave=True)
            except ImportError:
                self.bar = None

    def update(self, row: BenchRow) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{row.impl} {row.label} {row.direction}"[:60])
            self.bar.update(1)
            return
        speed = f"{row.ms:.4g} ms" if row.ms is not None else row.status
        note = f" | {' '.join(row.note.split())}" if row.note and row.status != "ok" else ""
        print(f"[{self.n}/{self.total}] {row.elapsed_s:.0f}s {row.suite} {row.op} {row.impl} | "
              f"{row.label} | {row.direction} | {speed}{note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _no_requires_grad(leaves):
    """The forward rows time what inference runs: leaf inputs without requires_grad (an autograd
    Function sees requires_grad inputs as needing gradients even under torch.no_grad)."""
    for x in leaves:
        x.requires_grad_(False)
    try:
        yield
    finally:
        for x in leaves:
            x.requires_grad_(True)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Runner:
    def __init__(self, settings: Settings, ceilings: Dict, on_row: Optional[Callable[[BenchRow], None]] = None):
        self.s = settings
        self.device = torch.device(settings.device)
        self.on_row = on_row
        if self.device.type == "cuda":
            _flush_buffer(self.device)      # allocated once, before any row's memory baseline
        self.ceilings = ceilings
        self.rows: List[BenchRow] = []
        self._gates: Dict[Tuple, GateResult] = {}
        self._res = _resources.RowResources(settings, ceilings, self.device)
        self._measured: Dict[Tuple, Dict[float, float]] = {}   # series key -> {work: ms}
        self._stalled: Dict[Tuple, str] = {}                   # (impl, direction) -> why its rows stop
        self.deadline: Optional[float] = None                 # perf_counter() time after which rows are skipped
        self.current: Optional[Tuple[Task, str]] = None       # the row running now (the watchdog names it)
        self.t0 = time.perf_counter()                         # rows record when they ended (elapsed_s)

    # ---------------------------------------------------------------- rows
    def _row(self, task: Task, direction: str, status: str, note: str = "", **measured) -> BenchRow:
        """The row of ``task`` in ``direction``; ``measured``: the fields a timed row fills (times, rates, gate)."""
        c = task.case
        return BenchRow(suite=task.suite, op=c["op"], impl=task.impl.name, provider=task.impl.provider,
                        family=task.impl.family, direction=direction,
                        dtype=DTYPE_NAMES.get(task.dtype, str(task.dtype)), label=cases.label(c),
                        case={k: v for k, v in c.items() if k not in ("op", "over_budget")}, tokens=cases.tokens(c),
                        status=status, note=note, elapsed_s=round(time.perf_counter() - self.t0, 2), **measured)

    def _emit(self, row: BenchRow, progress: Optional[Progress]) -> None:
        self._res.annotate(row)   # kernels, kernels_note, resources, roofline
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)
        if progress is not None:
            progress.update(row)

    # ---------------------------------------------------------------- one (impl, case)
    def run_task(self, task: Task, progress: Optional[Progress] = None) -> None:
        impl, dev = task.impl, self.device
        base_mem = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        state = {"bound": None, "used": False}   # the inputs bound once, shared by the task's directions
        try:
            for direction in task.directions:
                stalled = self._stalled.get((impl.name, direction))
                if stalled:
                    self._emit(self._row(task, direction, "skipped", stalled), progress)
                    continue
                left = None if self.deadline is None else self.deadline - time.perf_counter()
                if left is not None and left <= 0:
                    self._emit(self._row(task, direction, "skipped",
                                         f"suite time budget of {self.s.time_budget_s:.0f} s reached (--time-budget)"),
                               progress)
                    continue
                state["used"] = True
                limits = [x for x in (self.s.first_call_limit_s or None, left) if x is not None]
                limit = min(limits) if limits else None
                t0 = time.perf_counter()
                self.current = (task, direction)
                try:
                    with time_limit(limit):
                        row, keep_going = self._run_direction(task, direction, state, base_mem)
                    self.current = None
                    self._emit(row, progress)
                    if not keep_going:
                        return
                except RowTimeout:
                    self.current = None
                    state["bound"] = None
                    _free(dev)
                    _sync(dev)
                    spent = time.perf_counter() - t0
                    if left is not None and limit == left:
                        note = (f"stopped after {spent:.0f} s: the suite time budget of {self.s.time_budget_s:.0f} s "
                                f"ended")
                    else:
                        note = (f"stopped after {spent:.0f} s: the first call (compilation / autotuning) ran past the "
                                f"{self.s.first_call_limit_s:.0f} s limit (--first-call-limit)")
                        self._stalled[(impl.name, direction)] = note + "; this implementation's later rows are skipped"
                    self._emit(self._row(task, direction, "skipped", note), progress)
        finally:
            if state["bound"] is not None or state["used"]:
                state["bound"] = None
                _free(dev)

    def _predicted_ms(self, skey: Tuple, w: float) -> Optional[float]:
        """The time of a call of work ``w``, scaled from the largest smaller one measured in its series."""
        below = [x for x in self._measured.get(skey, {}) if x < w]
        if not below:
            return None
        x = max(below)
        return self._measured[skey][x] * w / x

    def _run_direction(self, task: Task, direction: str, state: Dict, base_mem: int) -> Tuple[BenchRow, bool]:
        """One row of ``task`` (emitted by the caller, outside the time limit), and False when the
        inputs do not fit in memory (the task's other rows cannot run either)."""
        impl, case, dev, dt = task.impl, task.case, self.device, task.dtype
        if case.get("over_budget"):
            return self._row(task, direction, "skipped",
                             f"KV cache of {case['over_budget'] / 1e9:.0f} GB exceeds the memory budget"), True
        grad = direction != "fwd"
        if grad and not impl.backward:
            return self._row(task, direction, "unavailable", "no backward pass (inference operator)"), True
        why = impl.why_not(case, dev, dt, grad)
        if why:
            return self._row(task, direction, "unavailable", why), True
        skey = (task.series or task.suite, impl.name, case["op"], direction, str(dt))
        w = cases.work(case)
        predicted = self._predicted_ms(skey, w)
        if predicted is not None and predicted > self.s.max_call_ms:
            return self._row(task, direction, "skipped", f"predicted {predicted:.0f} ms per call > budget "
                             f"{self.s.max_call_ms:.0f} ms (--max-call-ms)"), True
        gate, warm_ms = None, None
        if self.s.gate:
            gk = gate_key(impl, case, dt, grad, tiny=self.s.tiny)
            gate = self._gates.get(gk)
            if gate is None:
                if state["bound"] is None:
                    state["bound"] = self._bind(task)
                    if state["bound"] is None:
                        return self._row(task, direction, "skipped", "out of memory allocating the inputs"), False
                warm_ms = self._warm(state["bound"], grad)
                try:
                    gate = run_gate(impl, case, dev, dt, grad, self.s.seed, tiny=self.s.tiny)
                except Exception as e:  # noqa: BLE001 - every failure becomes a row
                    if is_unavailable_error(e):
                        return self._row(task, direction, "unavailable", f"{type(e).__name__}: {e}"), True
                    gate = GateResult(False, f"raised {type(e).__name__}: {e}")
                self._gates[gk] = gate
                _free(dev)
            if not gate.ok:
                return self._row(task, direction, "FAILED", "correctness gate: " + gate.message,
                                 gate={"ok": False, "message": gate.message}), True
        if state["bound"] is None:
            state["bound"] = self._bind(task)
            if state["bound"] is None:
                return self._row(task, direction, "skipped", "out of memory allocating the inputs"), False
        row = self._time(task, direction, state["bound"], gate, base_mem, warm_ms)
        if row.status == "ok":
            self._measured.setdefault(skey, {})[w] = row.ms
        return row, True

    def _bind(self, task: Task):
        """The implementation bound to inputs of the timed size; None when they do not fit in memory."""
        try:
            t = cases.make_inputs(task.case, self.device, task.dtype, seed=self.s.seed)
            bound = task.impl.bind(task.case, t)
            del t
            return bound
        except torch.cuda.OutOfMemoryError:
            _free(self.device)
            return None

    def _warm(self, b, grad: bool) -> Optional[float]:
        """One call at the timed size before the correctness probe runs (ms, compile and autotuning
        included; None if it raised: the timed call reports the error). Autotuners keyed without the
        sequence length (FLA's) keep the configuration of the first shape they see: that must be the
        timed shape, not the probe's."""
        leaves = [x for x in b.leaves if x.requires_grad]
        t0 = time.perf_counter()
        try:
            with b.context():
                if grad:
                    with torch.enable_grad():
                        out = b.fn()
                        out.backward(torch.ones_like(out))
                else:
                    with torch.no_grad(), _no_requires_grad(leaves):
                        b.fn()
                _sync(self.device)
        except Exception:  # noqa: BLE001
            return None
        finally:
            for x in leaves:
                x.grad = None
            _free(self.device)
        return (time.perf_counter() - t0) * 1e3

    def _time(self, task: Task, direction: str, b, gate: Optional[GateResult], base_mem: int,
              warm_ms: Optional[float] = None) -> BenchRow:
        dev, case = self.device, task.case
        leaves = [x for x in b.leaves if x.requires_grad]

        def clear():
            for x in leaves:
                x.grad = None
        before = clear if self.s.grads == "fresh" else None

        graph = {}
        try:
            # the untimed first call is watched (Triton launches; --resources: the profiler too)
            with b.context(), self._res.first_call(task, direction) as cap:
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.perf_counter()
                if direction == "fwd":   # inference: grad mode off and inputs that do not require grad
                    with torch.no_grad(), _no_requires_grad(leaves):
                        out = b.fn()
                        _sync(dev)
                        first = (time.perf_counter() - t0) * 1e3
                        cap.stop()
                        if not bool(torch.isfinite(out).all()):
                            return self._row(task, direction, "FAILED", "non-finite output at the timed size")
                        call = b.fn
                        est = estimate_ms(call, dev) if self.s.rep_ms > 0 else None
                        timing = self._measure(call, est, None)
                        if self.s.graphs and dev.type == "cuda" and case["op"].endswith("decode"):
                            graph = self._graph_timing(call)
                else:
                    with torch.enable_grad():
                        out = b.fn()
                        gen = torch.Generator(device=dev)
                        gen.manual_seed(self.s.seed + 3)
                        dout = torch.randn(out.shape, generator=gen, device=dev, dtype=torch.float32).to(out.dtype)
                        cap.mark("bwd")   # launches from here on are the backward's
                        if direction == "bwd":
                            out.backward(dout, retain_graph=True)
                            _sync(dev)
                            first = (time.perf_counter() - t0) * 1e3
                            cap.stop()
                            call = lambda: out.backward(dout, retain_graph=True)
                        else:
                            out.backward(dout)
                            _sync(dev)
                            first = (time.perf_counter() - t0) * 1e3
                            cap.stop()
                            call = lambda: b.fn().backward(dout)
                        bad = [i for i, x in enumerate(leaves)
                               if x.grad is not None and not bool(torch.isfinite(x.grad).all())]
                        if bad:
                            return self._row(task, direction, "FAILED",
                                             f"non-finite gradient(s) {bad} at the timed size")
                        est = estimate_ms(call, dev, before) if self.s.rep_ms > 0 else None
                        timing = self._measure(call, est, before)
                peak = (torch.cuda.max_memory_allocated(dev) - base_mem) / 2 ** 20 if dev.type == "cuda" else None
        except torch.cuda.OutOfMemoryError:
            _free(dev)
            return self._row(task, direction, "skipped", "out of memory")
        except Exception as e:  # noqa: BLE001
            if is_unavailable_error(e):
                return self._row(task, direction, "unavailable", f"{type(e).__name__}: {e}")
            tb = traceback.format_exc(limit=2).strip().splitlines()[-1]
            return self._row(task, direction, "FAILED", f"raised at the timed size: {tb}")
        return self._row(task, direction, "ok", "", **self._metrics(task, direction, b, out, leaves, timing),
                         first_call_ms=warm_ms if warm_ms is not None else first, peak_mem_mb=peak, **graph,
                         gate=None if gate is None else {"ok": True, "message": gate.message,
                                                         "max_error": gate.max_error, "bound": gate.bound})

    def _graph_timing(self, call) -> Dict:
        """``call`` captured once in a CUDA graph and timed as replays (how servers run a decode step:
        no host launch cost), by the same protocol as the eager rows. A call that cannot be captured
        gets a note instead of a time."""
        try:
            t = measure_graph(call, self.device, warmup_ms=self.s.warmup_ms, rep_ms=self.s.rep_ms,
                              min_reps=self.s.min_reps, max_reps=self.s.max_reps)
            return {"graph_ms": t.median_ms}
        except Exception as e:  # noqa: BLE001 - a peer that cannot be captured is a note, not a failure
            torch.cuda.synchronize()
            return {"graph_note": f"not capturable: {type(e).__name__}: {e}"}

    def _measure(self, call, est, before):
        return measure(call, self.device, warmup_ms=self.s.warmup_ms, rep_ms=self.s.rep_ms,
                       min_reps=self.s.min_reps, max_reps=self.s.max_reps, before=before, estimate=est)

    def _metrics(self, task: Task, direction: str, b, out, leaves, timing) -> Dict:
        case, op = task.case, task.case["op"]
        ms = timing.median_ms
        m = {"ms": ms, "ms_mean": timing.mean_ms, "ms_std": timing.std_ms, "ms_p20": timing.p20_ms,
             "ms_p80": timing.p80_ms, "ms_min": timing.min_ms, "reps": timing.reps}
        flops = None
        if op == "flash":
            flops = models.attention_flops(case["B"], case["H"], case["S"], case["S"], case["D"],
                                           causal=case.get("causal", True), direction=direction)
        elif op == "flash_varlen":
            flops = models.varlen_attention_flops(case["seqlens"], case["H"], case["D"], case.get("causal", True),
                                                  direction)
        elif op in ("flash_decode", "kvcache_decode"):
            flops = models.attention_flops(case["B"], case["H"], 1, case["ctx"], case["D"], causal=True)
        nbytes = models.io_bytes(b.inputs, out, leaves, direction, accumulate=self.s.grads == "accumulate")
        if op in ("kda_decode", "diag_decode"):
            nbytes += models.nbytes([b.inputs[-1]])          # the updated state is written back
        sec = ms / 1e3
        m["bytes"] = nbytes
        m["gbps"] = nbytes / sec / 1e9
        if self.ceilings.get("copy_gbps"):
            m["frac_copy"] = m["gbps"] / self.ceilings["copy_gbps"]
        if flops is not None:
            m["flops"] = flops
            m["tflops"] = flops / sec / 1e12
            if self.ceilings.get("gemm_tflops"):
                m["frac_gemm"] = m["tflops"] / self.ceilings["gemm_tflops"]
        m["tokens_per_s"] = cases.tokens(case) / sec
        return m

    def run(self, tasks: List[Task], desc: str) -> List[BenchRow]:
        total = sum(len(t.directions) for t in tasks)
        progress = Progress(total, desc)
        try:
            for task in tasks:
                self.run_task(task, progress)
        finally:
            progress.close()
        return self.rows


# -------------------------------------------------------------------- ceilings

def measure_ceilings(device: torch.device, settings: Settings) -> Dict:
    """Copy bandwidth (bytes read + written) and the dense GEMM rate, measured now."""
    out: Dict = {"device": str(device)}
    if device.type == "cuda":
        nbytes, n, gdt = 2 ** 30, 8192, torch.bfloat16
    else:
        nbytes, n, gdt = 2 ** 26, 512, torch.float32
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src.random_(0, 255)
        dst = torch.empty_like(src)
        call = functools.partial(dst.copy_, src)
        call()
        t = measure(call, device, warmup_ms=settings.warmup_ms, rep_ms=settings.rep_ms, min_reps=settings.min_reps)
        out["copy_gbps"] = 2 * nbytes / (t.median_ms / 1e3) / 1e9
        out["copy"] = f"copy_ of {nbytes / 2 ** 20:.0f} MiB, median {t.median_ms:.3f} ms over {t.reps} reps"
        del src, dst
        a = torch.randn(n, n, device=device, dtype=gdt)
        bm = torch.randn(n, n, device=device, dtype=gdt)
        c = torch.empty(n, n, device=device, dtype=gdt)
        call = functools.partial(torch.mm, a, bm, out=c)
        call()
        t = measure(call, device, warmup_ms=settings.warmup_ms, rep_ms=settings.rep_ms, min_reps=settings.min_reps)
        out["gemm_tflops"] = models.gemm_flops(n, n, n) / (t.median_ms / 1e3) / 1e12
        out["gemm"] = f"{DTYPE_NAMES[gdt]} GEMM {n}^3 random data, median {t.median_ms:.3f} ms over {t.reps} reps"
        del a, bm, c
    finally:
        _free(device)
    return out
