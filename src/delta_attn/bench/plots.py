"""PNG plots of a results folder (matplotlib, Agg; absent matplotlib = a note, no plots)."""
from __future__ import annotations

import os
import sys
from collections import OrderedDict
from typing import Dict, List, Optional

from .roofline import OPERATOR_ORDER, headline_rows, recorded_roofline


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        from .._install import BENCH
        print(f"delta-attn: matplotlib is not installed, no plots: {BENCH}", file=sys.stderr)
        return None


def _name(r: Dict) -> str:
    return r["impl"] + (f" [{r['op']}]" if r["family"] == "linear" else "")


def _series(rows: List[Dict], x_of, y_of) -> "OrderedDict[str, list]":
    out: "OrderedDict[str, list]" = OrderedDict()
    for r in rows:
        if r["status"] != "ok":
            continue
        y = y_of(r)
        if y is None:
            continue
        out.setdefault(_name(r), []).append((x_of(r), y))
    for k in out:
        out[k].sort()
    return out


def bar_labels(rows: List[Dict]) -> List[str]:
    """One label per row of ``ceiling_fraction.png``, each naming its op and each unique:
    ``impl [op] | case | direction`` (``| dtype`` when the rows mix dtypes; a label still repeated gets
    ``#2``, ``#3``, ... in row order). KDA and diagonal rows of one implementation and case differ by op."""
    dtypes = {r.get("dtype") for r in rows}
    labels = []
    for r in rows:
        lab = f"{r['impl']} [{r['op']}] | {r['label']} | {r['direction']}"
        if len(dtypes) > 1:
            lab += f" | {r.get('dtype')}"
        labels.append(lab)
    seen: Dict[str, int] = {}
    out = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab} #{seen[lab]}")
    return out


def _len_label(x, _pos=None) -> str:
    if x >= 2 ** 20:
        return f"{x / 2 ** 20:g}M"
    if x >= 1024:
        return f"{x / 1024:g}K"
    return f"{x:g}"


def _line_plot(plt, path, panels, xlabel, ylabel, title, logy=True, hlines=None):
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (sub, series) in zip(axes[0], panels):
        for name, pts in series.items():
            xs, ys = zip(*pts)
            style = "--" if "[" in name else "-"
            ax.plot(xs, ys, style, marker="o", ms=3, label=name)
        ax.set_xscale("log", base=2)
        from matplotlib.ticker import FuncFormatter
        ax.xaxis.set_major_formatter(FuncFormatter(_len_label))
        if logy:
            ax.set_yscale("log")
        for y, lab in (hlines or []):
            ax.axhline(y, color="k", lw=0.8, ls=":")
            ax.text(ax.get_xlim()[0], y, " " + lab, va="bottom", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(sub, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_plots(out_dir: str, run: Dict, rows: List[Dict]) -> List[str]:
    plt = _plt()
    if plt is None:
        return []
    suite = run.get("suite")
    made: List[str] = []
    ceil = run.get("ceilings") or {}
    dev = ((run.get("env") or {}).get("gpu") or {}).get("name") or "CPU"
    directions = ("fwd", "bwd", "fwd+bwd")
    combos = sorted({(r["dtype"], r["direction"]) for r in rows if r["suite"] == suite},
                    key=lambda t: (t[0], directions.index(t[1]) if t[1] in directions else 9))
    if suite in ("crossover", "matrix"):
        rs = [r for r in rows if r["op"] == "flash" or r["op"] in ("kda", "diag")]
        x_of = lambda r: r["case"]["S"]
        if suite == "matrix":
            rs = [r for r in rs if r["case"]["B"] * r["case"]["S"] >= 0]
        panels = [(f"{dt} {d}", _series([r for r in rs if r["dtype"] == dt and r["direction"] == d], x_of,
                                        lambda r: r["ms"]))
                  for dt, d in combos]
        if panels:
            _line_plot(plt, os.path.join(out_dir, "latency.png"), panels, "sequence length S", "ms (median)",
                       f"{suite}: latency vs S ({dev})")
            made.append("latency.png")
        panels = [(f"{dt} {d}", _series([r for r in rs if r["dtype"] == dt and r["direction"] == d], x_of,
                                        lambda r: r["tokens_per_s"] / 1e6)) for dt, d in combos]
        if panels:
            _line_plot(plt, os.path.join(out_dir, "throughput.png"), panels, "sequence length S", "M tokens/s",
                       f"{suite}: throughput vs S ({dev})")
            made.append("throughput.png")
        flash = [r for r in rs if r["op"] == "flash"]
        panels = [(f"{dt} {d}", _series([r for r in flash if r["dtype"] == dt and r["direction"] == d],
                                        x_of, lambda r: r.get("tflops"))) for dt, d in combos]
        if any(p[1] for p in panels):
            hl = [(ceil["gemm_tflops"], "GEMM ceiling")] if ceil.get("gemm_tflops") else None
            _line_plot(plt, os.path.join(out_dir, "tflops.png"), panels, "sequence length S", "TFLOP/s",
                       f"{suite}: attention TFLOP/s against the GEMM ceiling ({dev})", logy=False, hlines=hl)
            made.append("tflops.png")
    elif suite == "decode":
        grid = [r for r in rows if r["op"] != "kvcache_decode"]   # one shape only: its table is the report's
        batches = sorted({r["case"]["B"] for r in grid})
        panels = []
        for b in batches:
            rs = [r for r in grid if r["case"]["B"] == b]
            attn = _series([r for r in rs if r["op"] == "flash_decode"], lambda r: r["case"]["ctx"],
                           lambda r: r["ms"] * 1e3)
            ctxs = sorted({r["case"]["ctx"] for r in rs if r["op"] == "flash_decode"}) or [1]
            for r in rs:   # state decode does not depend on the context: a flat line
                if r["op"] in ("kda_decode", "diag_decode") and r["status"] == "ok":
                    attn[_name(r)] = [(c, r["ms"] * 1e3) for c in ctxs]
            panels.append((f"batch {b}", attn))
        if panels:
            _line_plot(plt, os.path.join(out_dir, "decode_latency.png"), panels, "context length",
                       "µs per decode step", f"decode: one token per sequence ({dev})")
            made.append("decode_latency.png")
    # every suite: fraction of the ceiling per row (bar chart)
    ok = [r for r in rows if r["status"] == "ok" and (r.get("frac_gemm") is not None or r.get("frac_copy") is not None)]
    if ok and suite in ("kernels", "crossover", "decode", "matrix"):
        ok = ok[:60] if suite != "kernels" else ok
        labels = bar_labels(ok)
        vals = [100 * (r["frac_gemm"] if r.get("frac_gemm") is not None and r["op"] in ("flash", "flash_varlen")
                       else r["frac_copy"]) for r in ok]
        colors = ["tab:blue" if r["op"] in ("flash", "flash_varlen") else "tab:orange" for r in ok]
        fig, ax = plt.subplots(figsize=(10, max(3, 0.22 * len(ok) + 1)))
        ax.barh(range(len(ok)), vals, color=colors)
        ax.set_yticks(range(len(ok)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("% of the ceiling (blue: TFLOP/s of GEMM; orange: GB/s of copy)")
        ax.set_title(f"{suite}: fraction of the measured ceilings ({dev})")
        ax.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "ceiling_fraction.png"), dpi=110)
        plt.close(fig)
        made.append("ceiling_fraction.png")
    return made


def roofline_plot(out_dir: str, run: Dict, rows: List[Dict], name: str = "roofline.png") -> Optional[str]:
    """A log-log roofline PNG: the memory roof (intensity × copy bandwidth) and the compute roof (GEMM
    rate) of the run's ceilings, one point per operator and implementation at the suite's headline
    shape, one panel per direction. Returns its path, or None (no ceilings, no point, no matplotlib)."""
    ceilings = run.get("ceilings") or {}
    if not ceilings.get("copy_gbps") or not ceilings.get("gemm_tflops"):
        return None
    pts = []
    for r in headline_rows(rows):
        rl = recorded_roofline(r, ceilings)
        if rl and rl.get("ai_flop_per_byte") and rl.get("achieved_tflops"):
            pts.append((r, rl))
    if not pts:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    dirs = [d for d in ("fwd", "bwd", "fwd+bwd") if any(r["direction"] == d for r, _ in pts)]
    dirs += sorted({r["direction"] for r, _ in pts} - set(dirs))
    bw, peak = ceilings["copy_gbps"] * 1e9, ceilings["gemm_tflops"] * 1e12
    ridge = peak / bw
    ais = [rl["ai_flop_per_byte"] for _, rl in pts]
    lo, hi = min(min(ais), ridge) / 8, max(max(ais), ridge) * 8
    colors = {op: f"C{i}" for i, op in enumerate(OPERATOR_ORDER)}
    fig, axes = plt.subplots(1, len(dirs), figsize=(6.5 * len(dirs), 5.2), squeeze=False)
    dev = ((run.get("env") or {}).get("gpu") or {}).get("name") or "CPU"
    for ax, d in zip(axes[0], dirs):
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(peak, x * bw) / 1e12 for x in xs], "k-", lw=1.2)
        ax.axvline(ridge, color="k", lw=0.6, ls=":")
        ax.text(ridge, lo * bw / 1e12, f" ridge {ridge:.0f} FLOP/B", fontsize=7, va="bottom", rotation=90)
        ax.text(lo, lo * bw / 1e12, f" copy {ceilings['copy_gbps']:.0f} GB/s", fontsize=7, va="bottom", rotation=0)
        ax.text(hi, peak / 1e12, f"GEMM {ceilings['gemm_tflops']:.0f} TFLOP/s ", fontsize=7, va="bottom", ha="right")
        for r, rl in pts:
            if r["direction"] != d:
                continue
            ours = r.get("provider") == "delta-attn"
            ax.scatter([rl["ai_flop_per_byte"]], [rl["achieved_tflops"]], color=colors.get(r["op"], "k"),
                       marker="o" if ours else "^", s=36, edgecolors="k" if ours else "none",
                       label=f"{r['op']}: {r['impl']}")
            ax.annotate(r["impl"].replace("delta-attn ", "ours "), (rl["ai_flop_per_byte"], rl["achieved_tflops"]),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte)")
        ax.set_ylabel("achieved TFLOP/s")
        ax.set_title(d, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(handles, labels, fontsize=6, loc="lower right")
    fig.suptitle(f"{run.get('suite', '')}: roofline at the headline shapes ({dev}; circles: delta-attn, triangles: "
                 "peers; KDA / diagonal FLOPs are a lower bound)", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
