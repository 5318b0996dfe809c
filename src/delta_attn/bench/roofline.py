"""A bench row on the roofline of the ceilings measured in the same run (copy bandwidth, GEMM rate):
its arithmetic intensity, the bound, the attainable and achieved rates (:func:`roofline`,
:func:`row_roofline`; the linear operators' FLOPs are a lower bound, :func:`linear_flops`), and the rows the
roofline plot shows (:func:`headline_rows`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional


def linear_flops(case: Dict, direction: str) -> Optional[float]:
    """A lower bound on the FLOPs of the linear operators (no agreed count exists; the chunked kernels
    do more), from their recurrent form, per token and head: KDA (7·D² + 2·D: decay the D×D state,
    kᵀS, the delta-rule outer-product update, qᵀS), diagonal 4·D (h = a·h + k·v, o = q·h). Backward
    2x the forward, fwd+bwd 3x. None for other operators."""
    op = case.get("op")
    d, h = case.get("D"), case.get("H")
    if d is None or h is None:
        return None
    if op in ("kda", "kda_decode"):
        per = 7 * d * d + 2 * d
    elif op in ("diag", "diag_decode"):
        per = 4 * d
    else:
        return None
    tokens = case["B"] * (1 if op.endswith("decode") else case["S"])
    return float(per * tokens * h) * {"fwd": 1.0, "bwd": 2.0, "fwd+bwd": 3.0}.get(direction, 1.0)


def roofline(flops: Optional[float], nbytes: Optional[float], ms: Optional[float], ceilings: Dict) -> Optional[Dict]:
    """A row against the run's ceilings (``copy_gbps``, ``gemm_tflops``): arithmetic intensity
    (FLOP/byte), ridge point (GEMM rate / copy bandwidth), the bound (compute when the intensity is at
    or past the ridge, else memory), the attainable rate min(GEMM, intensity x bandwidth) and the
    fraction of it achieved. Without FLOPs only the bandwidth side is given."""
    bw = (ceilings or {}).get("copy_gbps")
    peak = (ceilings or {}).get("gemm_tflops")
    if not nbytes or not ms or not bw or not peak:
        return None
    sec = ms / 1e3
    out = {"achieved_gbps": nbytes / sec / 1e9, "copy_gbps": bw, "gemm_tflops": peak,
           "ridge_flop_per_byte": peak * 1e12 / (bw * 1e9), "ai_flop_per_byte": None, "bound": "memory",
           "achieved_tflops": None, "attainable_tflops": None, "fraction": nbytes / sec / 1e9 / bw}
    if flops:
        ai = flops / nbytes
        attainable = min(peak * 1e12, ai * bw * 1e9)
        achieved = flops / sec
        out.update(ai_flop_per_byte=ai, bound="compute" if ai >= out["ridge_flop_per_byte"] else "memory",
                   achieved_tflops=achieved / 1e12, attainable_tflops=attainable / 1e12, fraction=achieved / attainable)
    return out


def row_roofline(row: Dict, ceilings: Dict) -> Optional[Dict]:
    """:func:`roofline` of an ok row: its own FLOPs (attention: flash-attn's count, docs/PEERS.md) or, for the linear
    operators, :func:`linear_flops` (``flops_model`` says which)."""
    if row.get("status") != "ok":
        return None
    flops, model = row.get("flops"), "flash-attn"
    if not flops:
        flops = linear_flops(dict(row.get("case") or {}, op=row.get("op")), row.get("direction", "fwd"))
        model = "recurrence (lower bound)" if flops else None
    r = roofline(flops, row.get("bytes"), row.get("ms"), ceilings)
    if r is not None:
        r["flops_model"] = model
    return r


def recorded_roofline(row: Dict, ceilings: Dict) -> Optional[Dict]:
    """The row's recorded roofline point, else :func:`row_roofline` (results files from before the resource report)."""
    return row.get("roofline") if row.get("roofline") is not None else row_roofline(row, ceilings)


# the order of the operators in the resource tables and the colours of the roofline plot
OPERATOR_ORDER = ("flash", "flash_varlen", "kda", "diag", "flash_decode", "kda_decode", "diag_decode")
# the suite's headline shape per operator (the roofline plot's points); absent labels fall back to the
# operator's first measured shape
HEADLINE = {"flash": "B=8 S=4096 H=16 D=128 causal", "kda": "B=8 S=4096 H=16 D=128",
            "diag": "B=8 S=4096 H=16 D=128", "kda_decode": "B=64 H=16 D=128", "diag_decode": "B=64 H=16 D=128",
            "flash_decode": "B=64 ctx=8192 H=16 D=128"}


def headline_rows(rows: List[Dict]) -> List[Dict]:
    """One ok row per (operator, implementation, direction) at the operator's headline shape (first
    dtype of the run), each with a roofline point (FLOPs known or bounded)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return []
    dtype = ok[0]["dtype"]
    out = []
    for op in OrderedDict.fromkeys(r["op"] for r in ok):
        rs = [r for r in ok if r["op"] == op and r["dtype"] == dtype]
        labels = [r["label"] for r in rs]
        want = HEADLINE.get(op)
        label = want if want in labels else (labels[0] if labels else None)
        seen = set()
        for r in rs:
            key = (r["impl"], r["direction"])
            if r["label"] == label and key not in seen:
                seen.add(key)
                out.append(r)
    return out
