"""The crossover suite's answer: where each linear operator (KDA, the gated diagonal; ours and the peers')
becomes faster than the fastest quadratic attention measured at the same length, and its speed-up at 128K
tokens, as data (:func:`crossover_summary`) and as report.md's sections (:func:`answer_section`,
:func:`crossover_section`). docs/BENCH.md ("Reading the crossover") says how the length is found.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from .text import cell, number, table


def _best_quadratic(rows: List[Dict], direction: str, dtype: str) -> Dict[int, Tuple[float, str]]:
    best: Dict[int, Tuple[float, str]] = {}
    for r in rows:
        if r["status"] == "ok" and r["family"] == "quadratic" and r["direction"] == direction and r["dtype"] == dtype:
            S = r["case"]["S"]
            if S not in best or r["ms"] < best[S][0]:
                best[S] = (r["ms"], r["impl"])
    return best


def crossover_point(lin: Dict[int, float], quad: Dict[int, float]) -> Tuple[Optional[float], str]:
    """Where the linear op's time falls below the quadratic one's for good: the shortest measured length from
    which it is faster at every longer common length, log-interpolated in S and in the time ratio between it
    and the length before. Returns (S or None, description); a ratio that dips below 1 and comes back is said
    as such, never "faster at every measured length"."""
    common = sorted(set(lin) & set(quad))
    if not common:
        return None, "no common measured length"
    ratio = [(S, lin[S] / quad[S]) for S in common]
    i = len(ratio)                 # ratio[i:] are all < 1
    while i > 0 and ratio[i - 1][1] < 1:
        i -= 1
    earlier = ", ".join(str(S) for S, r in ratio[:max(i - 1, 0)] if r < 1)    # faster, then slower again
    if i == len(ratio):
        return None, (f"not reached up to S = {common[-1]} (still {number(ratio[-1][1])}x the time" +
                      (f"; faster at S = {earlier} only)" if earlier else ")"))
    if i == 0:
        return float(common[0]), f"faster at every measured length (from S = {common[0]})"
    (s0, r0), (s1, r1) = ratio[i - 1], ratio[i]
    x = math.log(s0) + (math.log(s1) - math.log(s0)) * math.log(r0) / (math.log(r0) - math.log(r1))
    return math.exp(x), f"between S = {s0} and {s1}" + (f" (also faster at S = {earlier}, slower again at S = {s0})"
                                                         if earlier else "")


def _fmt_len(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x >= 10 * 1024:
        return f"{x / 1024:.0f}K"
    return f"{x / 1024:.1f}K".replace(".0K", "K") if x >= 1024 else f"{x:.0f}"


def crossover_text(x: Optional[float], how: str) -> str:
    """A crossover as a reader wants it: "6.9K", "≤ 1.0K" (faster from the shortest common length),
    "> 128K" (not reached up to the longest common length), or why there is none."""
    if how.startswith("faster at every"):
        return f"≤ {_fmt_len(x)}"
    if how.startswith("not reached"):
        return f"> {_fmt_len(float(how.split('S = ')[1].split()[0]))}"
    if x is None:
        return how
    return _fmt_len(x)


HEADLINE_S = 131072     # the answer quotes each linear operator's speed-up at 128K tokens


def _linear_impls(rows: List[Dict]) -> List[Tuple[str, str]]:
    """(impl, op) of the linear rows: KDA before diagonal, ours (delta-attn's own kernels) first."""
    found = OrderedDict.fromkeys((r["impl"], r["op"], r["provider"]) for r in rows if r["family"] == "linear")
    ordered = sorted(found, key=lambda k: (k[1] != "kda", k[1], k[2] != "delta-attn"))
    return [(impl, op) for impl, op, _ in ordered]


def _why_not_timed(rows: List[Dict]) -> str:
    """"not timed (status: note)" from the first of ``rows`` (one operator's) that did not run, in full."""
    notes = [r for r in rows if r["status"] != "ok"]
    return (f"not timed ({notes[0]['status']}: {cell(notes[0]['note'])})" if notes
            else "not timed (no row of it in this run)")


def linear_verdict(rows: List[Dict], impl: str, op: str, direction: str,
                   quad: Dict[int, float]) -> Tuple[Optional[float], str, str]:
    """One linear operator in one direction against the best quadratic time at each length (``quad``):
    (crossover S or None, where, the table's text). The text is a crossover length, "≤ S", "> S" or
    "not timed (reason)"."""
    mine = [r for r in rows if r["impl"] == impl and r["op"] == op and r["direction"] == direction]
    lin = {r["case"]["S"]: r["ms"] for r in mine if r["status"] == "ok"}
    if not lin:
        why = _why_not_timed(mine)
        return None, why, why
    if not set(lin) & set(quad):
        why = (f"not timed (at no length where attention was: this operator ran at S = "
               f"{', '.join(str(S) for S in sorted(lin))}, attention at " +
               (f"S = {', '.join(str(S) for S in sorted(quad))})" if quad else "none)"))
        return None, why, why
    x, how = crossover_point(lin, quad)
    return x, how, crossover_text(x, how)


def _lengths_run(rows: List[Dict], impl: str, op: str, direction: str) -> str:
    """The smoke test's cell: the lengths at which the operator ran and passed the gate, or why not."""
    mine = [r for r in rows if r["impl"] == impl and r["op"] == op and r["direction"] == direction]
    ran = sorted(r["case"]["S"] for r in mine if r["status"] == "ok")
    if not ran:
        return _why_not_timed(mine)
    return f"ran at S = {', '.join(str(S) for S in ran)}"


def answer_section(rows: List[Dict], smoke: bool = False) -> str:
    """The crossover suite's answer: for each linear operator (ours and the peers) and direction, the
    length past which it beats the best quadratic implementation, and its speed-up at 128K. A smoke test
    (``smoke``: the tiny mode) says only where each operator ran."""
    rows = [r for r in rows if r["suite"] == "crossover"]
    if not rows:
        return ""
    out = []
    dirs = [d for d in ("fwd", "fwd+bwd", "bwd") if any(r["direction"] == d for r in rows)]
    for dtype in sorted({r["dtype"] for r in rows}):
        rs = [r for r in rows if r["dtype"] == dtype]
        if smoke:
            out.append(f"**{dtype}**, smoke test (no crossover claimed):\n")
            out.append(table(["linear operator"] + dirs, [[f"{impl} [{op}]"] + [_lengths_run(rs, impl, op, d)
                                                                                  for d in dirs]
                                                           for impl, op in _linear_impls(rs)]))
            out.append("")
            continue
        quad = {d: _best_quadratic(rs, d, dtype) for d in dirs}
        head = ["linear operator"] + [f"crossover S, {d}" for d in dirs] + \
               [f"speed-up at {_fmt_len(HEADLINE_S)}, {d}" for d in dirs] + ["slowest first call"]
        lines = []
        for impl, op in _linear_impls(rs):
            mine = [r for r in rs if r["impl"] == impl and r["op"] == op]
            if not any(r["status"] == "ok" for r in mine):
                lines.append([f"{impl} [{op}]", _why_not_timed(mine)] + [""] * (2 * len(dirs) - 1) + ["-"])
                continue
            cross, speed = [], []
            for d in dirs:
                lin = {r["case"]["S"]: r["ms"] for r in mine if r["direction"] == d and r["status"] == "ok"}
                q = {S: v[0] for S, v in quad[d].items()}
                cross.append(linear_verdict(rs, impl, op, d, q)[2])
                common = sorted(set(lin) & set(q))
                if HEADLINE_S in lin and HEADLINE_S in q:
                    speed.append(f"{number(q[HEADLINE_S] / lin[HEADLINE_S])}x")
                elif common:
                    speed.append(f"not timed at {_fmt_len(HEADLINE_S)} ({number(q[common[-1]] / lin[common[-1]])}x at "
                                 f"{_fmt_len(common[-1])})")
                else:
                    speed.append("-")
            first = [r["first_call_ms"] for r in mine if r.get("first_call_ms") is not None]
            lines.append([f"{impl} [{op}]"] + cross + speed + [f"{max(first) / 1e3:.1f} s" if first else "-"])
        out.append(f"**{dtype}**, against the fastest quadratic implementation measured at each length:\n")
        out.append(table(head, lines))
        best = []
        for d in dirs:
            if HEADLINE_S in quad[d]:
                ms, name = quad[d][HEADLINE_S]
                best.append(f"{d}: {name}, {number(ms)} ms")
        if best:
            out.append(f"\nFastest quadratic implementation at S = {_fmt_len(HEADLINE_S)}: " + "; ".join(best) + ".")
        out.append("")
    return "\n".join(out)


def crossover_section(rows: List[Dict], smoke: bool = False) -> str:
    """Per direction: the latency table, then (not in a smoke test) the crossover lengths and the complete
    comparison."""
    rows = [r for r in rows if r["suite"] == "crossover"]
    if not rows:
        return ""
    out = []
    for dtype in sorted({r["dtype"] for r in rows}):
        for direction in [d for d in ("fwd", "bwd", "fwd+bwd") if any(r["direction"] == d for r in rows)]:
            rs = [r for r in rows if r["direction"] == direction and r["dtype"] == dtype]
            impls = list(OrderedDict.fromkeys(r["impl"] + (" [" + r["op"] + "]" if r["family"] == "linear" else "")
                                              for r in sorted(rs, key=lambda r: (r["family"] != "quadratic",
                                                                                 r["op"] != "kda"))))
            lengths = sorted({r["case"]["S"] for r in rs})
            cells = {}
            for r in rs:
                name = r["impl"] + (" [" + r["op"] + "]" if r["family"] == "linear" else "")
                cells[(name, r["case"]["S"])] = number(r["ms"]) if r["status"] == "ok" else r["status"].lower()
            out.append(f"### Latency, {direction}, {dtype} (ms, " +
                       ("one reading per row, smoke test" if smoke else "median") + "; B = tokens / S)")
            hdr = ["S", "B"] + impls
            lines = []
            for S in lengths:
                b = next(r["case"]["B"] for r in rs if r["case"]["S"] == S)
                lines.append([str(S), str(b)] + [cells.get((i, S), "") for i in impls])
            out.append(table(hdr, lines))
            if smoke:
                out.append("")
                continue
            # crossover lengths against the best quadratic implementation
            best = _best_quadratic(rs, direction, dtype)
            quad_ms = {S: v[0] for S, v in best.items()}
            lin_impls = list(OrderedDict.fromkeys((r["impl"], r["op"]) for r in rs if r["family"] == "linear"))
            lin_impls.sort(key=lambda io: io[1] != "kda")
            xl = []
            for impl, op in lin_impls:
                s = {r["case"]["S"]: r["ms"] for r in rs if r["impl"] == impl and r["op"] == op and r["status"] == "ok"}
                _, how, text = linear_verdict(rs, impl, op, direction, quad_ms)
                common = sorted(set(s) & set(quad_ms))
                last = (f"{number(quad_ms[common[-1]] / s[common[-1]])}x at S = {common[-1]}" if common else "-")
                xl.append([f"{impl} [{op}]", text, "-" if how == text else how, last])
            if xl:
                out.append(f"\n**Crossover, {direction}, {dtype}**: the sequence length past which each linear "
                           "operator is faster than the best quadratic one measured at that length.\n")
                out.append(table(["linear operator", "crossover S", "where", "speed-up at the longest common S"], xl))
            # the seeds' "complete comparison", measured
            lines = []
            for S in lengths:
                if S not in best:
                    continue
                b = next(r["case"]["B"] for r in rs if r["case"]["S"] == S)
                q, qn = best[S]
                line = [str(S), str(b), f"{number(q)} ({qn})"]
                for impl, op in lin_impls:
                    s = next((r["ms"] for r in rs if r["impl"] == impl and r["op"] == op and r["status"] == "ok"
                              and r["case"]["S"] == S), None)
                    line.append("-" if s is None else f"{number(s)} ({number(q / s)}x)")
                lines.append(line)
            if lines:
                out.append(f"\n**Complete comparison, {direction}, {dtype}** (ms; in brackets: speed-up of the linear "
                           "operator over the best quadratic one)\n")
                out.append(table(["S", "B", "best quadratic"] + [f"{i} [{o}]" for i, o in lin_impls], lines))
            out.append("")
    return "\n".join(out)


def crossover_summary(rows: List[Dict]) -> List[Dict]:
    """Crossover points as data: [{impl, op, direction, dtype, crossover_S, where}]."""
    out = []
    rows = [r for r in rows if r["suite"] == "crossover"]
    for dtype in sorted({r["dtype"] for r in rows}):
        for direction in sorted({r["direction"] for r in rows}):
            rs = [r for r in rows if r["direction"] == direction and r["dtype"] == dtype]
            quad = {S: v[0] for S, v in _best_quadratic(rs, direction, dtype).items()}
            for impl, op in OrderedDict.fromkeys((r["impl"], r["op"]) for r in rs if r["family"] == "linear"):
                x, how, _ = linear_verdict(rs, impl, op, direction, quad)
                out.append({"impl": impl, "op": op, "direction": direction, "dtype": dtype, "crossover_S": x,
                            "where": how})
    return out
