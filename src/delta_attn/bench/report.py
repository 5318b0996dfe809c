"""report.md of a results folder, and its plots: ``render(dir)`` rebuilds report.md, results.csv and the
plots from results.jsonl alone (results_files.py), so ``delta-attn report DIR`` works on any copied folder;
``write_index`` writes the top-level report of ``bench all``. The crossover suite's sections are crossover.py's.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict, defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

from . import anchors
from .crossover import answer_section, crossover_section
from .impls import CUDNN_KDA_NATIVE
from .results_files import read_jsonl, write_csv
from .roofline import OPERATOR_ORDER, recorded_roofline
from .text import byte_size, cell, number, percent, rate, table


def _key(r: Dict) -> Tuple:
    return (r["suite"], r["op"], r["impl"], r["direction"], r["dtype"], r["label"])


def env_block(run: Dict) -> str:
    env = run.get("env") or {}
    gpu = env.get("gpu") or {}
    opt = env.get("optional_packages") or {}
    lines = [
        ["GPU", (f"{gpu.get('name')} (compute capability {gpu.get('compute_capability')}, {gpu.get('sm_count')} SMs, "
                 f"{gpu.get('memory_gib')} GiB)") if gpu else "none (CPU run)"],
        ["driver", gpu.get("driver") or "-"],
        ["CUDA", env.get("cuda") or "-"],
        ["cuDNN", env.get("cudnn") or "-"],
        ["PyTorch", env.get("torch") or "-"],
        ["Triton", env.get("triton") or "-"],
        ["delta-attn", f"{env.get('delta_attn')} (git {env.get('git_revision') or 'unknown'})"],
        ["fla-core", opt.get("fla-core") or "not installed"],
        ["nvidia-cudnn-frontend", opt.get("nvidia-cudnn-frontend") or "not installed"],
        ["Python / platform", f"{env.get('python')} / {env.get('platform')}"],
        ["Triton interpreter", "on (CPU run)" if env.get("triton_interpreter") else "off"],
    ]
    return table(["", ""], lines)


def ceilings_block(run: Dict) -> str:
    c = run.get("ceilings") or {}
    if not c:
        return "_not measured_"
    return table(["ceiling", "measured", "how"], [
        ["copy bandwidth (bytes read + written)", rate(_scaled(c.get("copy_gbps"), 1e9), "B/s"), c.get("copy", "")],
        ["dense GEMM rate", rate(_scaled(c.get("gemm_tflops"), 1e12), "FLOP/s"), c.get("gemm", "")]])


def _scaled(x: Optional[float], factor: float) -> Optional[float]:
    return None if x is None else x * factor


SMOKE_NOTE = ("> **Smoke test** (tiny mode): toy sizes, the reference and Triton-interpreter paths, one timed call "
              "per row. It checks that every implementation runs and passes the correctness gate, and that every "
              "artifact is produced; its times are single readings that say nothing about speed, so this report "
              "claims no crossover and no speed-up.")


def first_calls_section(rows: List[Dict]) -> str:
    """Each implementation's slowest first call (compilation, autotuning), and the rows it cost."""
    per: "OrderedDict[str, List[Dict]]" = OrderedDict()
    for r in rows:
        per.setdefault(r["impl"] + (f" [{r['op']}]" if r["family"] == "linear" else ""), []).append(r)
    lines = []
    for name, rs in per.items():
        first = [r["first_call_ms"] for r in rs if r.get("first_call_ms") is not None]
        stopped = [r for r in rs if "--first-call-limit" in (r.get("note") or "")]
        if not first and not stopped:
            continue
        lines.append([name, f"{max(first) / 1e3:.1f} s" if first else "-",
                      f"{sum(first) / 1e3:.1f} s" if first else "-", str(len(stopped)) if stopped else "0"])
    if not lines:
        return ""
    return ("### First calls (compilation and autotuning, wall clock; not in the timed medians)\n" +
            table(["implementation", "slowest first call", "all first calls", "rows stopped by --first-call-limit"],
                   lines) + "\n")


# ------------------------------------------------------------------------------------------ row tables

_OP_TITLE = {"flash": "Flash attention", "flash_varlen": "Flash attention, packed variable-length batch",
             "kda": "Kimi Delta Attention", "diag": "Gated diagonal attention",
             "flash_decode": "Decode: attention over a KV cache",
             "kvcache_decode": "Decode: flash_attn_with_kvcache (append + attend)",
             "kda_decode": "Decode: KDA state update", "diag_decode": "Decode: diagonal state update"}


def _primary(r: Dict) -> Tuple[str, str]:
    """(rate, fraction of the ceiling) shown for a row: TFLOP/s for attention, GB/s otherwise."""
    if r.get("tflops") is not None and r["op"] in ("flash", "flash_varlen"):
        return rate(r["tflops"] * 1e12, "FLOP/s"), percent(r.get("frac_gemm"))
    if r.get("gbps") is not None:
        return rate(r["gbps"] * 1e9, "B/s"), percent(r.get("frac_copy"))
    return "-", "-"


def rows_section(rows: List[Dict], h200: bool, compare: Optional[Dict] = None, smoke: bool = False) -> str:
    """A table per operator; a smoke test compares no speeds ("vs best peer" is blank)."""
    out = []
    by_op = OrderedDict()
    for r in rows:
        by_op.setdefault((r["suite"], r["op"]), []).append(r)
    order = list(_OP_TITLE)
    for (suite, op), rs in sorted(by_op.items(), key=lambda kv: order.index(kv[0][1]) if kv[0][1] in order else 99):
        out.append(f"### {_OP_TITLE.get(op, op)} ({suite})")
        hdr = ["shape", "dtype", "dir", "implementation", "ms (median)", "spread p20-p80", "rate", "of ceiling",
               "Mtok/s", "vs best peer", "peak MiB"]
        if h200:
            hdr.append("peer figure (H200, docs/PEERS.md)")
        if compare is not None:
            hdr.append("vs old run")
        # best peer per (label, dtype, direction): fastest ok non-delta-attn row
        best_peer: Dict[Tuple, float] = {}
        for r in rs:
            if r["status"] == "ok" and r["provider"] != "delta-attn":
                k = (r["label"], r["dtype"], r["direction"])
                best_peer[k] = min(best_peer.get(k, float("inf")), r["ms"])
        lines = []
        for r in rs:
            if r["status"] != "ok":
                continue
            shown_rate, frac = _primary(r)
            k = (r["label"], r["dtype"], r["direction"])
            vs = "-"
            if r["provider"] == "delta-attn" and k in best_peer and not smoke:
                vs = f"{best_peer[k] / r['ms']:.2f}x"
            line = [r["label"], r["dtype"], r["direction"], r["impl"], number(r["ms"], 4),
                    f"{number(r['ms_p20'])}-{number(r['ms_p80'])}", shown_rate, frac, number(r["tokens_per_s"] / 1e6),
                    vs, number(r.get("peak_mem_mb"))]
            if h200:
                a = anchors.lookup(r)
                line.append("-" if a is None else f"{a[0]:g} {'TFLOP/s' if a[1] == 'tflops' else 'ms'} ({a[2]:.2f}x)")
            if compare is not None:
                old = compare.get(_key(r))
                line.append(f"{old / r['ms']:.2f}x" if old else "-")
            lines.append(line)
        out.append(table(hdr, lines) if lines else "_no row ran_")
        if op == "kda" and any(r["impl"] == CUDNN_KDA_NATIVE for r in rs):
            out += ["", CUDNN_ROWS_NOTE]
        out.append("")
    return "\n".join(out)


CUDNN_ROWS_NOTE = (
    f"The cuDNN KDA rows: `{CUDNN_KDA_NATIVE}` is the frontend called as its users call it, q / k / v as THD views, "
    "g and beta in float32 and `cu_seqlens` made once outside the timed call; its forward normalises q and k in "
    "the kernel, and its backward rows take q and k normalised once beforehand (that backward has no in-kernel "
    "norm). `delta-attn cudnn` is our adapter around the same engine: each call also casts g and beta to "
    "float32, reads g on the host for the strong-decay refusal (the engine returns NaN below about -5) and "
    "transposes states, so it is slower than the native row by that work and refuses calls with decays below "
    "-5. `delta-attn cudnn (q/k normed in torch)` adds the L2 norm of q and k in PyTorch inside the timed call. "
    "The native row is the peer to beat; the other two measure what our API adds around it. Our `delta-attn "
    "triton` rows take the inputs as drawn (g and beta in bf16), where the native row's float32 g and beta are "
    "made outside the timed call: our training kernels read the bf16 g and beta as given, and our fused forward "
    "widens g to float32 in a separate pass inside the timed call; every call of ours also runs the g <= 0 "
    "check (one reduction of g and a host read), which the frontend does not make.")


def matrix_section(rows: List[Dict]) -> str:
    rs = [r for r in rows if r["suite"] == "matrix" and r["status"] == "ok"]
    if not rs:
        return ""
    lines = [[r["label"], r["dtype"], r["impl"], number(r["ms"], 4), number(r["ms_mean"], 4), number(r["ms_std"], 2),
              number(r["tokens_per_s"] / 1e6), number(r.get("tflops"))] for r in rs]
    return ("### Config matrix (forward, non-causal)\n" +
            table(["shape", "dtype", "implementation", "median ms", "mean ms", "std ms", "M queries/s", "TFLOP/s"],
                  lines) + "\n")


def decode_section(rows: List[Dict], ceilings: Optional[Dict] = None) -> str:
    """Decode rows: eager time beside the CUDA-graph replay time (how servers run a step); the rates are
    those of the replay where the step could be captured."""
    rs = [r for r in rows if r["suite"] == "decode" and r["status"] == "ok"]
    if not rs:
        return ""
    copy = (ceilings or {}).get("copy_gbps")
    lines = []
    for r in rs:
        c = r["case"]
        if r["op"] in ("flash_decode", "kvcache_decode"):
            per_seq = 2 * c["ctx"] * c["Hk"] * c["D"] * (4 if r["dtype"] == "fp32" else 2)
            what = f"KV cache, ctx {c['ctx']}" + (f", Hq/Hk {c['H']}/{c['Hk']}" if c["H"] != c["Hk"] else "") + (
                f", pages of {c['page']}" if c.get("page") else (", contiguous" if r["op"] == "kvcache_decode" else ""))
        elif r["op"] == "kda_decode":
            per_seq, what = c["H"] * c["D"] * c["D"] * 4, "KDA state (fp32)"
        else:
            per_seq, what = c["H"] * c["D"] * 4, "diagonal state (fp32)"
        ms = r.get("graph_ms") or r["ms"]
        gbps = r["bytes"] / (ms / 1e3) / 1e9
        graph = number(r["graph_ms"] * 1e3, 4) if r.get("graph_ms") else cell(r.get("graph_note") or "-")
        lines.append([str(c["B"]), what, r["impl"], number(r["ms"] * 1e3, 4), graph, number(r["tokens"] / (ms / 1e3)),
                      rate(gbps * 1e9, "B/s"), percent(gbps / copy) if copy else "-", byte_size(per_seq)])
    return ("### Decode: one new token per sequence (rows that did not run are listed below)\n"
            "Rates are those of the CUDA-graph replay where the step could be captured, else of the eager call.\n\n" +
            table(["batch", "memory read per token", "implementation", "eager µs", "graph replay µs", "tokens/s",
                    "bytes/s", "of copy", "bytes per sequence"], lines) + "\n")


def not_run_section(rows: List[Dict]) -> str:
    groups: Dict[Tuple[str, str, str], List[str]] = defaultdict(list)
    for r in rows:
        if r["status"] != "ok":
            groups[(r["status"], r["impl"], r["note"])].append(f"{r['label']} {r['direction']}")
    if not groups:
        return "Every row ran and passed the correctness gate."
    lines = []
    for (status, impl, note), where in sorted(groups.items(), key=lambda kv: (kv[0][0] != "FAILED", kv[0])):
        shown = ", ".join(where[:4]) + (f" and {len(where) - 4} more" if len(where) > 4 else "")
        lines.append([f"**{status}**" if status == "FAILED" else status, impl, cell(note),
                      f"{len(where)}: {shown}"])
    return table(["status", "implementation", "reason", "rows"], lines)


def compare_section(rows: List[Dict], old_rows: List[Dict], old_dir: str) -> str:
    old = {_key(r): r for r in old_rows if r["status"] == "ok"}
    lines = []
    for r in rows:
        o = old.get(_key(r))
        if r["status"] == "ok" and o is not None:
            lines.append([r["label"], r["dtype"], r["direction"], r["impl"], number(o["ms"], 4), number(r["ms"], 4),
                          f"{o['ms'] / r['ms']:.2f}x"])
    if not lines:
        return f"No row of this run matches a row of `{old_dir}`."
    return (f"Speed-up = old time / new time (> 1: this run is faster); old run: `{old_dir}`.\n\n" +
            table(["shape", "dtype", "dir", "implementation", "old ms", "new ms", "speed-up"], lines))


# ------------------------------------------------------------------------------------------ kernel resources

def _figure(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "-"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    return f"{x:,}" if isinstance(x, int) and abs(x) >= 10000 else str(x)


def _kib(b) -> str:
    if b is None:
        return "-"
    return f"{b / 1024:.1f} KiB" if b >= 1024 else f"{b} B"


def _kernel_cell(s: str) -> str:
    return str(s).replace("|", "/").replace("\n", " ")


def _shorten(name: Optional[str], n: int = 70) -> str:
    name = name or "?"
    return name if len(name) <= n else name[: n - 1] + "…"


def config_text(k: Dict) -> str:
    c = k.get("config") or {}
    if not c:
        return "-"
    parts = [f"{n}={v}" for n, v in (c.get("constexprs") or {}).items()]
    parts.append(f"warps={c.get('num_warps')}")
    parts.append(f"stages={c.get('num_stages')}")
    if (c.get("num_ctas") or 1) > 1:
        parts.append(f"ctas={c['num_ctas']}")
    if c.get("maxnreg"):
        parts.append(f"maxnreg={c['maxnreg']}")
    return " ".join(parts)


def _kernel_table(header: List[str], lines: Iterable[List[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(_kernel_cell(c) for c in line) + " |" for line in lines]
    return "\n".join(out)


def kernel_lines(row: Dict, limits_sms: Optional[int] = None) -> List[List[str]]:
    lines = []
    for k in row.get("kernels") or []:
        occ = k.get("occupancy") or {}
        grid = k.get("grid")
        progs = k.get("programs")
        sms = limits_sms
        grid_txt = "-" if grid is None else ("×".join(str(g) for g in grid if g != 1) or "1")
        if progs is not None and sms:
            grid_txt += f" ({progs / sms:.2f}× SMs)" if progs != 1 else ""
        lines.append([row["impl"], row["label"], row["direction"], k.get("phase", ""),
                      "`" + _shorten(k.get("kernel")) + "`",
                      config_text(k), _figure(k.get("regs")), _figure(k.get("spills")), _kib(k.get("shared")), grid_txt,
                      _figure(occ.get("programs_per_sm")), occ.get("binding") or "-", _figure(occ.get("waves")),
                      _figure(k.get("launches")), _figure(k.get("device_us"))])
    return lines


def wanted(run: Optional[Dict], rows: List[Dict]) -> bool:
    """Whether report.md gets the resource section and roofline.png: any row has kernels, or the suite
    is the kernels suite."""
    return (run or {}).get("suite") == "kernels" or any(r.get("kernels") for r in rows)


def resources_section(rows: List[Dict], run: Optional[Dict] = None) -> str:
    """Markdown for report.md: per operator, one table of the kernels of every row; one roofline table;
    for rows without kernel figures, why. Empty when the run collected nothing and is not the
    kernels suite."""
    run = run or {}
    have = [r for r in rows if r.get("kernels")]
    if not wanted(run, rows):
        return ""
    ceilings = run.get("ceilings") or {}
    out = ["## Kernel resources and roofline", ""]
    limits = next((r["resources"]["limits"] for r in have if (r.get("resources") or {}).get("limits")), None)
    sms = limits.get("sm_count") if limits else None
    if limits:
        out += [f"Device limits, from {limits.get('source')}: {limits.get('sm_count')} SMs; per SM "
                f"{limits.get('regs_per_sm'):,} registers (per warp in units of {limits.get('reg_alloc_unit')}, "
                f"{limits.get('reg_subpartitions')} sub-partitions, ≤ {limits.get('max_regs_per_thread')} per "
                f"thread), "
                f"{_kib(limits.get('smem_per_sm'))} shared memory (≤ {_kib(limits.get('smem_per_block_optin'))} per "
                f"block + {_kib(limits.get('smem_reserved_per_block'))} reserved), {limits.get('max_threads_per_sm')} "
                f"threads, {limits.get('max_blocks_per_sm')} blocks.", ""]
    out += ["Each Triton kernel launched by a row's untimed first call (no extra run), read from the compiled kernel "
            "at launch: config (constexpr tile sizes, warps, pipeline stages), registers per thread, spills (local "
            "memory per thread in 4-byte words, as Triton reports it), shared memory per program, grid (programs, "
            "and as a multiple of the SM count), resident programs per SM and the limit that binds it (CUDA's "
            "occupancy calculator: registers, shared memory, threads, blocks), waves = programs / (SMs × resident). "
            "A `bwd` row lists its backward's kernels only. Device µs: the PyTorch profiler's time of that kernel "
            "in the first call (`--resources`); kernels other than Triton's (cuDNN, FlashAttention-2) appear "
            "there by name only: their resource figures cannot be read.", ""]
    hdr = ["implementation", "case", "dir", "phase", "kernel", "config", "regs", "spills", "smem", "grid",
           "programs/SM", "bound by", "waves", "launches", "device µs"]
    by_op: "OrderedDict[str, List[Dict]]" = OrderedDict()
    for r in sorted(have, key=lambda r: OPERATOR_ORDER.index(r["op"]) if r["op"] in OPERATOR_ORDER else 99):
        by_op.setdefault(r["op"], []).append(r)
    for op, rs in by_op.items():
        lines = [line for r in rs for line in kernel_lines(r, sms)]
        out += [f"<details><summary><b>{op}</b>: {len(rs)} rows, {len(lines)} kernel entries</summary>", "",
                _kernel_table(hdr, lines), "", "</details>", ""]
    # rows without figures, grouped by reason
    why: Dict[str, List[str]] = defaultdict(list)
    for r in rows:
        if not r.get("kernels") and r.get("status") == "ok":
            why[r.get("kernels_note") or "no kernel figures recorded (a results file from before the resource "
                                           "report)"].append(f"{r['impl']} {r['label']} {r['direction']}")
    if why:
        out += ["**No kernel figures in this run.** Why:" if not have else "Rows without kernel figures:", ""]
        for note, where in why.items():
            shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
            out.append(f"- {note} ({len(where)} rows: {shown})")
        out.append("")
    # roofline table
    lines = []
    for r in sorted(rows, key=lambda r: OPERATOR_ORDER.index(r["op"]) if r.get("op") in OPERATOR_ORDER else 99):
        rl = recorded_roofline(r, ceilings)
        if rl is None:
            continue
        ach = (f"{_figure(rl['achieved_tflops'])} TFLOP/s, " if rl.get("achieved_tflops") is not None else "") + \
            f"{_figure(rl['achieved_gbps'])} GB/s"
        att = f"{_figure(rl['attainable_tflops'])} TFLOP/s" if rl.get("attainable_tflops") is not None else \
            f"{_figure(rl['copy_gbps'])} GB/s"
        lines.append([r["op"], r["impl"], r["label"], r["dtype"], r["direction"],
                      rl.get("flops_model") or "none (bytes only)",
                      _figure(rl.get("ai_flop_per_byte")), rl["bound"], ach, att, f"{100 * rl['fraction']:.0f}%"])
    if lines:
        ridge = next((recorded_roofline(r, ceilings) for r in rows if recorded_roofline(r, ceilings)), None)
        out += ["### Roofline", "",
                f"Ceilings of this run: copy {_figure(ceilings.get('copy_gbps'))} GB/s, GEMM "
                f"{_figure(ceilings.get('gemm_tflops'))} TFLOP/s: ridge point "
                f"{_figure(ridge['ridge_flop_per_byte'])} FLOP/byte. "
                "Intensity = FLOPs / bytes (the rows' byte model); bound = compute at or past the ridge, else "
                "memory; attainable = min(GEMM rate, intensity × copy bandwidth); fraction = achieved / "
                "attainable (for a memory-side point that is the fraction of the copy bandwidth, whatever the "
                "FLOP count). FLOPs: flash-attn's count for attention (docs/PEERS.md); for KDA and the diagonal "
                "recurrence a lower bound from the recurrent form (KDA 7·D²+2·D, diagonal 4·D per token and head; "
                "backward 2x).", "",
                _kernel_table(["operator", "implementation", "case", "dtype", "dir", "FLOP model", "FLOP/byte", "bound",
                        "achieved", "attainable", "of attainable"], lines), ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ report

GRADS_NOTE = {
    "accumulate": "add into the leaves' existing `.grad` from the second call on (triton's do_bench protocol, as "
                  "docs/PEERS.md; the byte model counts the accumulation: one read of each new gradient, a read and a "
                  "write of the sum).",
    "fresh": "are reset to None before every call, outside the timed region (the backward kernels alone).",
}


def markdown(run: Dict, rows: List[Dict], plots: List[str], old: Optional[Tuple[str, List[Dict]]] = None) -> str:
    suite = run.get("suite", "?")
    env = run.get("env") or {}
    gpu = (env.get("gpu") or {}).get("name") or ""
    h200 = "H200" in gpu
    counts = defaultdict(int)
    for r in rows:
        counts[r["status"]] += 1
    parts = [f"# delta-attn bench {suite}", ""]
    if run.get("interrupted"):
        parts += ["> **Interrupted**: this report holds only the rows measured before the run was stopped" +
                  (f" ({run['stopped']})" if run.get("stopped") else "") + ".", ""]
    parts += [
             f"Command: `{run.get('command', '')}`  ",
             f"Started {run.get('started', '?')} UTC, took {number(run.get('duration_s'))} s; rows: " +
             ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".", ""]
    smoke = bool(run.get("tiny"))
    if smoke:
        parts += [SMOKE_NOTE, ""]
    if suite == "crossover" and smoke:
        parts += ["## Smoke test: where each linear operator ran", "",
                  "Each cell lists the lengths at which the operator ran and passed the correctness gate, or why it "
                  "did not run. No crossover is claimed: run `delta-attn bench crossover` on a GPU for the answer.",
                  "", answer_section(rows, smoke=True)]
    elif suite == "crossover":
        parts += ["## The answer: where linear attention overtakes quadratic attention", "",
                  "Crossover S: the sequence length (B = tokens / S, causal) past which the linear operator is faster "
                  "than every quadratic implementation measured at that length; \"≤\" = faster from the shortest "
                  "common length, \">\" = not reached up to the longest. Speed-up: the fastest quadratic "
                  "implementation's time over the linear operator's.", "", answer_section(rows)]
    parts += ["## Environment", "", env_block(run), "", "## Ceilings (measured at the start of this run)", "",
              ceilings_block(run), ""]
    compare = None
    if old is not None:
        compare = {_key(r): r["ms"] for r in old[1] if r["status"] == "ok"}
    parts += ["## Results", ""]
    if suite == "crossover":
        parts.append(crossover_section(rows, smoke))
    if suite == "matrix":
        parts.append(matrix_section(rows))
    if suite == "decode":
        parts.append(decode_section(rows, run.get("ceilings")))
    parts.append(rows_section(rows, h200, compare, smoke))
    parts.append(first_calls_section(rows))
    parts.append(resources_section(rows, run))       # kernels per row and roofline
    parts += ["## Rows that did not run", "", not_run_section(rows), ""]
    if old is not None:
        parts += ["## Comparison with an earlier run", "", compare_section(rows, old[1], old[0]), ""]
    if plots:
        parts += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    parts += ["## How this was measured", "", method_text(run, rows), ""]
    return "\n".join(parts)


def _on_gpu(run: Dict) -> bool:
    """Whether the run timed a CUDA device (runs that predate the recorded device were GPU runs)."""
    device = (run.get("settings") or {}).get("device") or (run.get("ceilings") or {}).get("device") or "cuda"
    return str(device).startswith("cuda")


def _timing_text(run: Dict, rows: List[Dict]) -> str:
    """What the timer did in this run: the clock, the repeats, the warm-up and the flush."""
    st = run.get("settings") or {}
    cuda = _on_gpu(run)
    reps = sorted({r["reps"] for r in rows if r.get("status") == "ok" and r.get("reps")})
    n = ("-" if not reps else str(reps[0]) if len(reps) == 1 else f"{reps[0]} to {reps[-1]}")
    clock = "CUDA events" if cuda else "the CPU wall clock (`time.perf_counter`)"
    warm = st.get("warmup_ms")
    warmup = ("no warm-up" if warm == 0 else f"a warm-up of about {warm:g} ms of calls" if warm else "a warm-up")
    flush = ("with the L2 cache flushed before every call" if cuda else "nothing flushed between calls")
    if reps == [1]:
        return (f"Each time is a single call timed with {clock} after the row's untimed first call, {warmup}, "
                f"{flush}: one reading, not a median (the p20-p80 spread collapses to it).")
    return (f"Each time is the median of {n} timed calls per row ({clock}), after {warmup}, {flush} "
            f"(p20-p80 is the spread).")


def method_text(run: Dict, rows: List[Dict]) -> str:
    """The report's method section: what actually ran in this run."""
    # runs written before the setting existed reset the gradients before every call
    settings_grads = (run.get("settings") or {}).get("grads", "fresh")
    peak = (" Peak MiB: the most memory allocated during the row beyond what was allocated before its inputs."
            if _on_gpu(run) else " Peak MiB is not measured on the CPU.")
    return (_timing_text(run, rows) + " The first call of each row (compilation, autotuning) is excluded and "
            "reported as `first_call_ms` in results.jsonl. Before any timing, every "
            "implementation's output (and gradients, for rows with a backward pass) is checked against the float64 "
            "reference on a probe of the same configuration with the error rule of docs/TESTING.md; a row that fails "
            "is FAILED and carries no speed. FLOPs: forward 4·B·H·(visible query-key pairs)·D, backward 2.5x, "
            "fwd+bwd 3.5x; bytes: inputs read once, outputs written once. `fwd` rows run with autograd off. "
            f"Backward rows: gradients {GRADS_NOTE[settings_grads]} Fractions are of the ceilings above.{peak} "
            "See docs/BENCH.md.")


def render(out_dir: str, compare_dir: Optional[str] = None, plots: bool = True) -> str:
    """(Re)write report.md, results.csv and the plots of ``out_dir`` from its results.jsonl."""
    run, rows = read_jsonl(os.path.join(out_dir, "results.jsonl"))
    write_csv(os.path.join(out_dir, "results.csv"), rows)
    pngs: List[str] = []
    if plots:
        from . import plots as P
        pngs = P.make_plots(out_dir, run, rows)
        pngs += [os.path.basename(p) for p in [wanted(run, rows) and P.roofline_plot(out_dir, run, rows)] if p]
    old = None
    if compare_dir is not None:
        old = (compare_dir, read_jsonl(os.path.join(compare_dir, "results.jsonl"))[1])
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write(markdown(run, rows, pngs, old))
    return path


def write_index(root: str, command: str) -> str:
    """``bench all``: the top-level report.md of ``root``, one section per suite folder below it, the
    crossover answer first."""
    parts = ["# delta-attn bench all", "", f"Command: `{command}`", ""]
    folders = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "results.jsonl")))
    folders.sort(key=lambda d: d != "crossover")
    for d in folders:
        run, rows = read_jsonl(os.path.join(root, d, "results.jsonl"))
        counts = defaultdict(int)
        for r in rows:
            counts[r["status"]] += 1
        parts += [f"## {run.get('suite', d)}", "",
                  f"[{d}/report.md]({d}/report.md): {number(run.get('duration_s'))} s, rows: " +
                  (", ".join(f"{n} {st}" for st, n in sorted(counts.items())) or "none") + ".", ""]
        if run.get("suite") == "crossover":
            parts += [answer_section(rows, smoke=bool(run.get("tiny"))), ""]
    path = os.path.join(root, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path
