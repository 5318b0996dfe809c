"""Peer figures measured on one NVIDIA H200 (docs/PEERS.md), keyed like the benchmark's rows.

Shown next to a peer's row only when the run's GPU is an H200, so that a run can be checked
against the bars (the acceptance asks for agreement within 10%). Units: "tflops" or "ms".
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

_FLASH = [  # (D, S, causal, cuDNN fwd, cuDNN fwd+bwd, FA2 fwd, FA2 fwd+bwd, mem-efficient fwd)
    (128, 1024, False, 558, 438, 332, 238, 171), (128, 4096, False, 603, 517, 348, 301, 178),
    (128, 4096, True, 548, 452, 321, 269, 167), (128, 16384, False, 619, 558, 350, 319, 180),
    (128, 16384, True, 590, 538, 337, 312, 174), (128, 32768, True, 605, 555, 339, 325, 176),
    (64, 4096, False, 448, 426, 309, 277, 135), (64, 16384, True, 449, 435, 309, 281, 134),
]

ANCHORS: Dict[Tuple[str, str, str], Tuple[float, str]] = {}


def _flash_label(b, s, h, d, causal):
    return f"B={b} S={s} H={h} D={d}" + (" causal" if causal else "")


for d, s, c, cf, cfb, ff, ffb, mf in _FLASH:
    lab = _flash_label(32768 // s, s, 2048 // d, d, c)
    ANCHORS[("cuDNN (SDPA)", lab, "fwd")] = (cf, "tflops")
    ANCHORS[("cuDNN (SDPA)", lab, "fwd+bwd")] = (cfb, "tflops")
    ANCHORS[("FA2 (SDPA flash)", lab, "fwd")] = (ff, "tflops")
    ANCHORS[("FA2 (SDPA flash)", lab, "fwd+bwd")] = (ffb, "tflops")
    ANCHORS[("mem-efficient (SDPA)", lab, "fwd")] = (mf, "tflops")
for s, f, fb in ((4096, 392, 249), (16384, 433, 305)):
    lab = _flash_label(32768 // s, s, 16, 128, True)
    ANCHORS[("FLA parallel_attn", lab, "fwd")] = (f, "tflops")
    ANCHORS[("FLA parallel_attn", lab, "fwd+bwd")] = (fb, "tflops")
for b, t, f, fb in ((8, 4096, 1.89, 10.1), (1, 32768, 2.84, 13.0), (64, 1024, 3.67, 20.0), (1, 131072, 11.3, 52.0)):
    ANCHORS[("FLA chunk_kda", f"B={b} S={t} H=16 D=128", "fwd")] = (f, "ms")
    ANCHORS[("FLA chunk_kda", f"B={b} S={t} H=16 D=128", "fwd+bwd")] = (fb, "ms")
for b, t, f, fb in ((8, 4096, 0.50, 1.46), (1, 32768, 0.95, 2.48)):
    ANCHORS[("FLA chunk_hgrn", f"B={b} S={t} H=16 D=128", "fwd")] = (f, "ms")
    ANCHORS[("FLA chunk_hgrn", f"B={b} S={t} H=16 D=128", "fwd+bwd")] = (fb, "ms")
ANCHORS[("FLA fused_recurrent_kda", "B=64 H=16 D=128", "fwd")] = (0.056, "ms")
# the crossover table (64K tokens per batch, H = 16, D = 128, causal)
for s, b, cf, kf, df, cfb, kfb, dfb in ((1024, 64, 0.55, 3.67, 0.95, 3.12, 20.0, 2.86),
                                        (4096, 16, 2.02, 3.71, 0.99, 8.48, 20.2, 2.90),
                                        (16384, 4, 7.46, 3.98, 1.09, 28.5, 20.7, 2.99),
                                        (65536, 1, 28.9, 5.71, 1.93, 111, 26.1, 5.00),
                                        (131072, 1, 141, 11.3, 3.83, 450, 52.0, 9.94)):
    ANCHORS.setdefault(("cuDNN (SDPA)", _flash_label(b, s, 16, 128, True), "fwd"), (cf, "ms"))
    ANCHORS.setdefault(("cuDNN (SDPA)", _flash_label(b, s, 16, 128, True), "fwd+bwd"), (cfb, "ms"))
    ANCHORS.setdefault(("FLA chunk_kda", f"B={b} S={s} H=16 D=128", "fwd"), (kf, "ms"))
    ANCHORS.setdefault(("FLA chunk_kda", f"B={b} S={s} H=16 D=128", "fwd+bwd"), (kfb, "ms"))
    ANCHORS.setdefault(("FLA chunk_hgrn", f"B={b} S={s} H=16 D=128", "fwd"), (df, "ms"))
    ANCHORS.setdefault(("FLA chunk_hgrn", f"B={b} S={s} H=16 D=128", "fwd+bwd"), (dfb, "ms"))


def lookup(row: Dict) -> Optional[Tuple[float, str, float]]:
    """(anchor value, unit, measured / anchor as a speed ratio: > 1 = faster than the anchor)."""
    if row.get("status") != "ok" or row.get("dtype") != "bf16":
        return None
    a = ANCHORS.get((row["impl"], row["label"], row["direction"]))
    if a is None:
        return None
    value, unit = a
    if unit == "tflops":
        if not row.get("tflops"):
            return None
        return value, unit, row["tflops"] / value
    return value, unit, value / row["ms"]
