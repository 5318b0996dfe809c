"""bench/rows.py: a row's ``to_json()`` is what results.jsonl held before the rows were typed, key for key and in
order, so the recorded results under benchmarks/results/ stay readable and render as they did."""
import json
import pathlib

import torch

from delta_attn.bench import impls
from delta_attn.bench.rows import BenchRow, ScalingRow
from delta_attn.bench.runner import Runner, Settings, Task

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _recorded_rows(suite):
    for path in sorted(RESULTS.glob(f"{suite}/*/results.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("record") == "row":
                yield path, rec


def _keys(cls):
    return list(cls.__dataclass_fields__)


def test_bench_rows_write_the_recorded_keys_in_order():
    want = ["record"] + _keys(BenchRow)
    newest = None
    for suite in ("kernels", "crossover", "decode"):
        for path, rec in _recorded_rows(suite):
            # older runs recorded a subset (no resource report yet): every key they hold is a field, in order
            assert [k for k in want if k in rec] == list(rec), (path, rec["impl"])
            if "roofline" in rec:
                newest = rec
    assert newest is not None and list(newest) == want


def test_scaling_rows_write_the_recorded_keys_in_order():
    want = ["record"] + _keys(ScalingRow)
    seen = 0
    for path, rec in _recorded_rows("scaling"):
        assert [k for k in want if k in rec] == list(rec), path
        seen += rec["status"] == "ok" and "mem_ratio" in rec and list(rec) == want
    assert seen


def test_a_runner_row_is_a_bench_row_and_its_json_is_complete():
    s = Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=1, max_reps=1)
    case = dict(op="diag", B=1, S=9, H=2, D=4)
    [impl] = [i for i in impls.catalogue("diag", torch.device("cpu")) if i.name == "delta-attn torch"]
    [row] = Runner(s, {"copy_gbps": 1.0}).run([Task("kernels", case, impl, ("fwd",), torch.float32)], "test")
    assert isinstance(row, BenchRow) and row.status == "ok", row.note
    rec = row.to_json()
    assert list(rec) == ["record"] + _keys(BenchRow) and rec["record"] == "row" and rec["ms"] == row.ms
    assert rec["case"] == {"B": 1, "S": 9, "H": 2, "D": 4}
    assert rec["kernels"] is None and rec["kernels_note"]          # the resource report says why there are none


def test_the_kda_table_says_what_each_cudnn_row_and_ours_include():
    """With the native cuDNN-FE row in a KDA table, the report explains the adapter rows against it and what our
    own rows run that it does not (inputs as drawn, the widening of g in the forward, the g <= 0 check)."""
    from delta_attn.bench import report
    base = dict(suite="kernels", op="kda", status="ok", label="B=8 S=4096", dtype="bf16", direction="fwd",
                ms=1.0, ms_p20=0.9, ms_p80=1.1, tokens_per_s=1e9, peak_mem_mb=1.0)
    rows = [dict(base, provider="delta-attn", impl="delta-attn triton"),
            dict(base, provider="cudnn", impl=impls.CUDNN_KDA_NATIVE, ms=0.5)]
    text = report.rows_section(rows, h200=False)
    assert "0.50x" in text
    assert "The native row is the peer to beat" in text
    assert "widens g to float32" in text and "g <= 0 check" in text
    assert "g <= 0 check" not in report.rows_section(rows[:1], h200=False)
