"""The ``delta-attn`` command."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

# a row's first call (compile / autotune) may take this long before it is stopped: long enough for our
# cold compiles and FLA's forward autotuning, short enough that one peer cannot starve the crossover
FIRST_CALL_LIMIT_S = 120.0
# a suite's rows end by then, so that with start-up and the report a plain GPU run takes under 10 minutes
TIME_BUDGET_S = 510.0
CROSSOVER_TOKENS = 65536


def _cmd_env(args) -> int:
    from . import env
    info = env.collect()
    print(json.dumps(info, indent=2, default=str) if args.json else env.render(info))
    return 0


def _cmd_bench(args) -> int:
    import os
    import time

    import torch

    from .bench import SUITES

    device, tiny = args.device, args.tiny
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            print("delta-attn bench: no CUDA GPU is visible: running the tiny CPU mode (--device cpu --tiny): "
                  "reference and Triton-interpreter paths at toy sizes, one timed call per row: a smoke test that "
                  "checks that everything runs and claims no crossover",
                  file=sys.stderr)
    if device == "cuda" and not torch.cuda.is_available():
        print("delta-attn bench: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2
    if device == "cpu" and not tiny:
        print("delta-attn bench: on the CPU only the tiny mode runs (--tiny implied)", file=sys.stderr)
        tiny = True
    if device == "cpu":
        # the Triton backend runs on CPU tensors through the interpreter; set before any kernel import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .bench import Settings, run_suite

    # CPU: float16 (the Triton interpreter mishandles bf16 dots; the flash kernels take fp16/bf16 only)
    dtypes = tuple(args.dtype) if args.dtype else (("fp16",) if device == "cpu" else
                                                   (("fp16", "bf16") if args.suite == "matrix" else ("bf16",)))
    s = Settings(device=device, tiny=tiny, quick=args.quick, dtypes=dtypes, seed=args.seed,
                 impls=tuple(args.impls or ()), ops=tuple(args.ops or ()), directions=tuple(args.directions or ()),
                 gate=not args.no_gate,
                 tokens=min(args.tokens or CROSSOVER_TOKENS, 32) if tiny else (args.tokens or CROSSOVER_TOKENS),
                 heads=args.heads if not tiny else 2,
                 head_dim=args.head_dim if not tiny else 16, max_seq=args.max_seq, max_linear_seq=args.max_linear_seq,
                 grads=args.grads)
    s.resources = args.resources
    if args.quick:
        s.warmup_ms, s.rep_ms, s.max_call_ms = 10.0, 40.0, 1500.0
    if tiny:
        s.warmup_ms, s.rep_ms, s.min_reps, s.max_reps, s.max_call_ms = 0.0, 0.0, 1, 1, 3000.0
    # each GPU suite stops its rows at TIME_BUDGET_S so that, with start-up and the report, it ends within
    # 10 minutes (0 = no limit)
    s.time_budget_s = args.time_budget if args.time_budget is not None else (0.0 if tiny else TIME_BUDGET_S)
    s.first_call_limit_s = (args.first_call_limit if args.first_call_limit is not None
                            else (0.0 if tiny else FIRST_CALL_LIMIT_S))
    for name in ("warmup_ms", "rep_ms", "min_reps", "max_reps", "max_call_ms"):
        v = getattr(args, name)
        if v is not None:
            setattr(s, name, v)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    command = "delta-attn " + " ".join(args.argv)
    if args.suite == "scaling":
        from .bench.scaling import STRONG_TOKENS, run_scaling
        s.tokens = args.tokens if args.tokens is not None else STRONG_TOKENS
        out = args.out or os.path.join(".bench-out", f"scaling-{stamp}")
        path = run_scaling(s, out, command=command)
        if path is not None:                  # rank 0 writes the report
            print(f"delta-attn bench scaling: wrote {path} (and results.jsonl) in {out}")
        return 0
    if args.suite != "all":
        out = args.out or os.path.join(".bench-out", f"{args.suite}-{stamp}")
        path = run_suite(args.suite, s, out, command=command, plots=not args.no_plots)
        print(f"delta-attn bench {args.suite}: wrote {path} (and results.jsonl, results.csv, plots) in {out}")
        return 0
    from .bench.report import write_index
    root = args.out or os.path.join(".bench-out", f"all-{stamp}")
    for suite in SUITES[:-1]:
        path = run_suite(suite, s, os.path.join(root, suite), command=command, plots=not args.no_plots)
        print(f"delta-attn bench {suite}: wrote {path}")
    print(f"delta-attn bench all: wrote {write_index(root, command)}")
    return 0


def _cmd_report(args) -> int:
    from .bench.report import render
    path = render(args.dir, compare_dir=args.compare, plots=not args.no_plots)
    print(f"delta-attn report: wrote {path}")
    return 0


def _add_bench(sub) -> None:
    from .bench.suites import SUITES
    b = sub.add_parser("bench", help="time every implementation against its peers and write a report",
                       description="Suites: crossover (linear vs quadratic attention over sequence length), kernels "
                                   "(each operator against its peers at the bar shapes), matrix (the SDPA config "
                                   "matrix), decode (KV-cache attention vs state decode), ceilings, scaling (context "
                                   "parallelism on N GPUs: run under torchrun --nproc-per-node N), all. "
                                   "Writes results.jsonl, results.csv, report.md and PNG plots to --out.")
    b.add_argument("suite", choices=list(SUITES) + ["scaling", "all"])
    b.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: the GPU when one is visible, else the tiny CPU mode")
    b.add_argument("--tiny", action="store_true", help="toy sizes (CPU mode: reference and Triton-interpreter paths)")
    b.add_argument("--quick", action="store_true", help="fewer shapes and repeats (a few minutes on a GPU)")
    b.add_argument("--out", help="output folder (default .bench-out/<suite>-<time>)")
    b.add_argument("--dtype", action="append", choices=("bf16", "fp16", "fp32"),
                   help="repeatable (default bf16; matrix: fp16 and bf16; CPU: fp16)")
    b.add_argument("--impls", nargs="+", metavar="SUBSTR", help="only implementations whose name contains one of these")
    b.add_argument("--ops", nargs="+", choices=("kda", "kda_decode", "flash", "flash_varlen", "flash_decode", "diag",
                                                "diag_decode"), help="kernels suite: only these operators")
    b.add_argument("--directions", nargs="+", choices=("fwd", "bwd", "fwd+bwd"))
    b.add_argument("--tokens", type=int, help="crossover: tokens per batch (default 64K); scaling: tokens in all "
                                                "for strong scaling (default 1M)")
    b.add_argument("--heads", type=int, default=16)
    b.add_argument("--head-dim", type=int, default=128)
    b.add_argument("--max-seq", type=int, default=131072, help="crossover: longest quadratic S (default 128K)")
    b.add_argument("--max-linear-seq", type=int, default=1048576, help="crossover: longest linear S (default 1M)")
    b.add_argument("--max-call-ms", type=float,
                   help="skip a row whose predicted single call exceeds this (default 2500)")
    b.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help=f"rows not started after this many seconds are skipped with a note, and a row still running "
                        f"then is stopped (default {TIME_BUDGET_S:.0f} on a GPU, "
                        "so a suite ends within 10 minutes; 0 = no limit)")
    b.add_argument("--first-call-limit", type=float, metavar="SECONDS",
                   help=f"stop a row whose first call (compilation, autotuning) runs longer than this, and skip that "
                        f"implementation's later rows in that direction (default {FIRST_CALL_LIMIT_S:.0f} on a GPU; "
                        "0 = no limit)")
    b.add_argument("--warmup-ms", type=float, help="warm-up per row (default 25)")
    b.add_argument("--rep-ms", type=float, help="timed calls per row fill this many ms (default 100)")
    b.add_argument("--min-reps", type=int, help="at least this many timed calls (default 3)")
    b.add_argument("--max-reps", type=int, help="at most this many timed calls (default 100)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--grads", choices=("accumulate", "fresh"), default="accumulate",
                   help="backward rows: gradients add into .grad from the second call on (default; do_bench's "
                        "protocol, as the peer figures of docs/PEERS.md) or are reset before every call (the backward "
                        "kernels alone)")
    b.add_argument("--no-gate", action="store_true", help="skip the correctness gate (rows say so)")
    # per-kernel resource report (bench/resources.py)
    b.add_argument("--resources", dest="resources", action="store_const", const="full", default="auto",
                   help="add every row's kernels to results.jsonl and report.md: Triton kernels' config, registers, "
                        "spills, shared memory, grid, occupancy, plus every kernel's name and device time through the "
                        "PyTorch profiler (peers' too), and a roofline. Default: on in the kernels suite without the "
                        "profiler (the Triton launch hooks watch the untimed first call only: no extra run); off "
                        "elsewhere")
    b.add_argument("--no-resources", dest="resources", action="store_const", const="off",
                   help="collect no kernel figures (the roofline table stays: it is arithmetic on the row)")
    b.add_argument("--no-plots", action="store_true")
    b.set_defaults(func=_cmd_bench)
    r = sub.add_parser("report", help="re-render report.md, results.csv and plots of a results folder")
    r.add_argument("dir")
    r.add_argument("--compare", metavar="OLD_DIR", help="add speed-up columns against an earlier results folder")
    r.add_argument("--no-plots", action="store_true")
    r.set_defaults(func=_cmd_report)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="delta-attn", description="delta-attn: attention kernels and benchmarks")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("env", help="versions, GPU, optional packages and usable backends")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(func=_cmd_env)
    _add_bench(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
