"""``delta-attn bench``: the benchmark suites (matrix, kernels, crossover, decode, ceilings).

>>> from delta_attn.bench import Settings, run_suite
>>> out = run_suite("crossover", Settings(device="cpu", tiny=True, dtypes=("fp32",)), "/tmp/x")  # doctest: +SKIP

Every implementation is optional and discovered at run time; every row passes the correctness gate
before it is timed; the output folder holds results.jsonl, results.csv, report.md and PNG plots.
See docs/BENCH.md.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Optional

from .runner import Settings
from .suites import SUITES

__all__ = ["Settings", "SUITES", "run_suite"]

# after the time budget ends, a row still running in native code gets this long before the process
# writes its report and stops (bench/__init__.run_suite's watchdog)
WATCHDOG_GRACE_S = 15.0


def run_suite(suite: str, settings: Settings, out_dir: str, command: Optional[str] = None,
              plots: bool = True) -> str:
    """Run ``suite`` and write the results folder; returns the path of report.md."""
    import torch

    from .. import env as _env
    from . import crossover, report, results_files, suites, text
    from .runner import Runner, measure_ceilings

    settings.check()
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; one of {', '.join(SUITES)}")
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(settings.seed)
    device = torch.device(settings.device)
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    print(f"delta-attn bench {suite}: measuring the ceilings (copy bandwidth, GEMM) ...", file=sys.stderr, flush=True)
    ceilings = measure_ceilings(device, settings)
    print(f"  copy {text.rate(ceilings['copy_gbps'] * 1e9, 'B/s')}, "
          f"GEMM {text.rate(ceilings['gemm_tflops'] * 1e12, 'FLOP/s')}",
          file=sys.stderr, flush=True)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8e9
    tasks = suites.build(suite, settings, kv_budget_bytes=0.4 * free)
    run = {"suite": suite, "command": command or " ".join(["delta-attn"] + sys.argv[1:]),
           "started": started.strftime("%Y-%m-%d %H:%M:%S"), "duration_s": None, "interrupted": False,
           "tiny": settings.tiny, "quick": settings.quick, "settings": settings.as_dict(), "env": _env.collect(),
           "ceilings": ceilings}
    path = os.path.join(out_dir, "results.jsonl")
    # rows are appended as they come, so an interrupted run still leaves a readable folder
    results_files.write_jsonl(path, run, [])
    sink = open(path, "a")

    def on_row(row):
        sink.write(results_files.row_json(row.to_json()) + "\n")
        sink.flush()

    runner = Runner(settings, ceilings, on_row=on_row)
    finishing = threading.Lock()

    def finish() -> str:
        """The final results.jsonl (run record with duration and crossover points), then the report."""
        run["duration_s"] = time.perf_counter() - t0
        rows = [r.to_json() for r in runner.rows]
        if suite == "crossover" and not settings.tiny:      # a smoke test claims no crossover
            run["crossover"] = crossover.crossover_summary(rows)
        results_files.write_jsonl(path, run, rows)
        return report.render(out_dir, plots=plots)

    def hard_stop() -> None:
        """The time budget's backstop. A row is stopped at the budget's end by SIGALRM, but a signal only
        lands between Python bytecodes: a row stuck in native code (a compiler, a peer's autotuning) could
        run on. WATCHDOG_GRACE_S later this thread writes the report of the rows measured and ends the
        process, so that a plain run always ends in time."""
        if not finishing.acquire(blocking=False):
            return
        current = runner.current
        if current is not None:
            task, direction = current
            runner.rows.append(runner._row(task, direction, "skipped",
                                           f"abandoned: still running {WATCHDOG_GRACE_S:.0f} s after the time budget "
                                           f"of {settings.time_budget_s:.0f} s ended; the suite stopped here"))
        run["interrupted"] = True
        run["stopped"] = (f"the process was ended {WATCHDOG_GRACE_S:.0f} s after the time budget, with a row still "
                          "running in native code")
        out = finish()
        print(f"delta-attn bench {suite}: time budget ended with a row stuck in native code; wrote {out} and "
              "stopped the process (any later suite of `bench all` did not run)", file=sys.stderr, flush=True)
        os._exit(0)

    watchdog = None
    if settings.time_budget_s > 0:
        runner.deadline = t0 + settings.time_budget_s
        watchdog = threading.Timer(settings.time_budget_s + WATCHDOG_GRACE_S, hard_stop)
        watchdog.daemon = True
        watchdog.start()
    previous = _sigterm_raises_interrupt()
    try:
        runner.run(tasks, desc=f"bench {suite}")
    except KeyboardInterrupt:
        run["interrupted"] = True
        print(f"delta-attn bench {suite}: interrupted; writing the {len(runner.rows)} rows measured so far",
              file=sys.stderr, flush=True)
    finally:
        _restore_sigterm(previous)
    if not finishing.acquire(blocking=False):     # the watchdog is writing the report and ends the process
        threading.Event().wait()
    if watchdog is not None:
        watchdog.cancel()
    sink.close()
    return finish()


def _sigterm_raises_interrupt():
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:       # not the main thread
        return None


def _restore_sigterm(previous) -> None:
    import signal
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
