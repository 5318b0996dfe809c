"""The files of a results folder that hold the measurements: results.jsonl and results.csv.

results.jsonl: the first line is the run record (``"record": "run"``: suite, command, dates,
environment, ceilings, settings), then one ``"record": "row"`` line per (implementation, case,
direction): a row's ``to_json()`` (bench/rows.py); the schema is in docs/BENCH.md. results.csv holds the
rows' main columns (:data:`CSV_FIELDS`).
"""
from __future__ import annotations

import csv
import json
import math
from typing import Dict, List, Tuple

SCHEMA_VERSION = 1
CSV_FIELDS = ["suite", "op", "impl", "provider", "family", "direction", "dtype", "label", "tokens", "status",
              "ms", "ms_mean", "ms_std", "ms_p20", "ms_p80", "ms_min", "reps", "first_call_ms", "flops", "tflops",
              "frac_gemm", "bytes", "gbps", "frac_copy", "tokens_per_s", "peak_mem_mb", "graph_ms", "gate_max_error",
              "gate_bound", "note", "case"]


def row_json(row: Dict) -> str:
    return json.dumps(_finite(row), default=str)


def _finite(x):
    """NaN / inf become null (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_jsonl(path: str, run: Dict, rows: List[Dict]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(_finite(dict(run, record="run", schema=SCHEMA_VERSION)), default=str) + "\n")
        for r in rows:
            f.write(row_json(r) + "\n")


def read_jsonl(path: str) -> Tuple[Dict, List[Dict]]:
    run, rows = {}, []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if rec.get("record") == "run":
                run = rec
            elif rec.get("record") == "row":
                rows.append(rec)
    return run, rows


def write_csv(path: str, rows: List[Dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            flat = dict(r)
            g = r.get("gate") or {}
            flat["gate_max_error"], flat["gate_bound"] = g.get("max_error"), g.get("bound")
            flat["case"] = json.dumps(r.get("case", {}))
            w.writerow(flat)
