"""Text of the bench reports: numbers, rates and percentages as the reports print them, and Markdown tables."""
from __future__ import annotations

import math
from typing import Iterable, List, Optional


def number(x, digits: int = 3) -> str:
    """``digits`` significant digits; thousands separated from 1000 on; "-" for None, NaN and inf."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def rate(x: Optional[float], unit: str) -> str:
    """A rate with an SI prefix that keeps three significant digits (0.05 TFLOP/s is "50 GFLOP/s")."""
    if x is None or not math.isfinite(x):
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{number(x / scale)} {prefix}{unit}"
    return f"{number(x)} {unit}"


def percent(x) -> str:
    """A fraction as a whole percentage; "-" for None."""
    return "-" if x is None else f"{100 * x:.0f}%"


def cell(text: str) -> str:
    """Any text (a multi-line error, a note with a pipe) as one Markdown table cell, in full."""
    return " ".join(str(text).split()).replace("|", "/")


def table(header: List[str], lines: Iterable[List[str]]) -> str:
    """A Markdown table; the cells as given (pass text through :func:`cell`)."""
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
    return "\n".join(out)


def byte_size(n: float) -> str:
    """A byte count in B, KiB, MiB, ... with three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PiB"
