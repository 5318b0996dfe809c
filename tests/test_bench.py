"""delta-attn bench: the tiny CPU crossover end to end, report re-rendering and --compare, the
correctness gate (a wrong implementation is FAILED with no speed), missing peers, and the models."""
import json
import math
import os
import shutil

import pytest
import torch

from delta_attn import cli
from delta_attn.bench import cases, impls, models, report
from delta_attn.bench.impls import Bound, Impl
from delta_attn.bench.runner import Runner, Settings, Task
from delta_attn.bench.timer import measure, summarize

ROW_KEYS = {"record", "suite", "op", "impl", "provider", "family", "direction", "dtype", "label", "case", "tokens",
            "status", "note", "ms", "ms_mean", "ms_std", "ms_p20", "ms_p80", "ms_min", "reps", "first_call_ms",
            "flops", "tflops", "frac_gemm", "bytes", "gbps", "frac_copy", "tokens_per_s", "peak_mem_mb", "gate"}
SPEED_KEYS = ("ms", "ms_mean", "ms_std", "tflops", "gbps", "tokens_per_s")


@pytest.fixture(scope="module")
def crossover_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bench") / "crossover")
    assert cli.main(["bench", "crossover", "--device", "cpu", "--tiny", "--out", out]) == 0
    return out


def _read(out):
    return report.read_jsonl(os.path.join(out, "results.jsonl"))


def test_crossover_tiny_writes_every_artifact(crossover_dir):
    for name in ("results.jsonl", "results.csv", "report.md", "latency.png", "throughput.png"):
        path = os.path.join(crossover_dir, name)
        assert os.path.getsize(path) > 0, name
    with open(os.path.join(crossover_dir, "latency.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    run, rows = _read(crossover_dir)
    assert run["record"] == "run" and run["schema"] == report.SCHEMA_VERSION and run["suite"] == "crossover"
    for key in ("torch", "triton", "delta_attn", "git_revision", "gpu", "cudnn", "cuda"):
        assert key in run["env"]
    assert run["ceilings"]["copy_gbps"] > 0 and run["ceilings"]["gemm_tflops"] > 0
    assert rows and all(ROW_KEYS <= set(r) for r in rows)
    ok = [r for r in rows if r["status"] == "ok"]
    # the reference path of all three operators and a quadratic peer ran, in both directions
    ran = {(r["impl"], r["op"], r["direction"]) for r in ok}
    for op in ("flash", "kda", "diag"):
        for d in ("fwd", "fwd+bwd"):
            assert ("delta-attn torch", op, d) in ran
    assert ("torch SDPA (CPU)", "flash", "fwd") in ran
    for r in ok:
        assert r["ms"] > 0 and r["gate"]["ok"] and r["bytes"] > 0 and r["tokens_per_s"] > 0
        assert r["case"]["B"] * r["case"]["S"] >= 32 if r["case"]["S"] <= 32 else r["case"]["B"] == 1
        if r["op"] == "flash":   # causal: visible pairs S (S + 1) / 2
            S, d = r["case"]["S"], r["case"]["D"]
            fwd = 4 * r["case"]["B"] * r["case"]["H"] * d * S * (S + 1) // 2
            assert r["flops"] == pytest.approx(fwd * (1 if r["direction"] == "fwd" else 3.5))
    # rows that did not run carry no speed and say why
    for r in rows:
        if r["status"] != "ok":
            assert all(r[k] is None for k in SPEED_KEYS) and r["note"]
    # CSV: one line per row
    with open(os.path.join(crossover_dir, "results.csv")) as f:
        assert len(f.read().strip().splitlines()) == len(rows) + 1
    md = open(os.path.join(crossover_dir, "report.md")).read()
    for text in ("## Environment", "## Ceilings", "Crossover, fwd", "Complete comparison, fwd+bwd", "## Rows that did not run",
                 "Tiny CPU mode", "delta-attn torch [kda]", "![latency.png](latency.png)"):
        assert text in md, text
    # the crossover points are data too
    assert {(c["impl"], c["direction"]) for c in run["crossover"]} >= {("delta-attn torch", "fwd")}


def test_missing_peer_is_a_row_with_the_install_hint(crossover_dir):
    _, rows = _read(crossover_dir)
    fla = [r for r in rows if r["provider"] == "fla-core"]
    assert {r["impl"] for r in fla} >= {"FLA parallel_attn", "FLA chunk_kda", "FLA chunk_hgrn"}
    if impls.package_available("fla"):
        pytest.skip("fla-core is installed here")
    assert all(r["status"] == "unavailable" and "not installed: pip install fla-core" in r["note"] for r in fla)


def test_report_rerenders_and_compares(crossover_dir, tmp_path):
    old = str(tmp_path / "old")
    shutil.copytree(crossover_dir, old)
    # make the old run twice as slow: every matched row must show a 2.00x speed-up
    run, rows = _read(old)
    for r in rows:
        if r["ms"] is not None:
            r["ms"] *= 2
    report.write_jsonl(os.path.join(old, "results.jsonl"), run, rows)
    new = str(tmp_path / "new")
    shutil.copytree(crossover_dir, new)
    os.remove(os.path.join(new, "report.md"))
    os.remove(os.path.join(new, "results.csv"))
    assert cli.main(["report", new, "--compare", old, "--no-plots"]) == 0
    md = open(os.path.join(new, "report.md")).read()
    assert "## Comparison with an earlier run" in md and "vs old run" in md
    section = md.split("## Comparison with an earlier run")[1]
    speedups = [line.rsplit("|", 2)[-2].strip() for line in section.splitlines() if line.startswith("| B=")]
    assert speedups and all(s == "2.00x" for s in speedups)
    assert os.path.exists(os.path.join(new, "results.csv"))


def _fake(name, fn_out, raises=False):
    """An implementation of diag whose output is ``fn_out(reference output)``."""
    def bind(case, t):
        leaves = [impls._leaf(t[n]) for n in ("q", "k", "v", "g")]
        spec = cases.spec("diag", case, t)

        def fn():
            if raises:
                raise RuntimeError("kernel exploded")
            return fn_out(spec(leaves, True))
        return Bound(fn=fn, leaves=leaves, spec=spec, inputs=leaves)
    return Impl(name, "diag", "linear", "delta-attn", bind, lambda c, d, t, g: None)


def test_failed_rows_carry_no_speed():
    s = Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=1, max_reps=1)
    runner = Runner(s, {"copy_gbps": 1.0, "gemm_tflops": 1.0})
    case = dict(op="diag", B=1, S=9, H=2, D=4)
    good = _fake("right", lambda o: o)
    wrong = _fake("wrong", lambda o: o + 0.01)
    nan = _fake("nan", lambda o: o * float("nan"))
    boom = _fake("boom", None, raises=True)
    tasks = [Task("kernels", case, i, ("fwd", "fwd+bwd"), torch.float32) for i in (good, wrong, nan, boom)]
    rows = runner.run(tasks, "test")
    by = {(r["impl"], r["direction"]): r for r in rows}
    assert by[("right", "fwd")]["status"] == "ok" and by[("right", "fwd+bwd")]["status"] == "ok"
    assert by[("right", "fwd")]["ms"] > 0
    for name in ("wrong", "nan", "boom"):
        for d in ("fwd", "fwd+bwd"):
            r = by[(name, d)]
            assert r["status"] == "FAILED", (name, d, r["note"])
            assert all(r[k] is None for k in SPEED_KEYS)
            assert r["note"].startswith("correctness gate")
    assert "kernel exploded" in by[("boom", "fwd")]["note"]
    md = report.markdown({"suite": "kernels"}, rows, [])
    assert "**FAILED**" in md


def test_unavailable_backend_row_carries_the_registry_reason(monkeypatch):
    monkeypatch.setattr(impls, "package_available", lambda m: False)
    s = Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=1, max_reps=1)
    runner = Runner(s, {})
    case = dict(op="flash", B=1, S=8, H=2, Hk=2, D=8, causal=True)
    tasks = [Task("kernels", case, i, ("fwd",), torch.float32) for i in impls.catalogue("flash", torch.device("cpu"))]
    rows = {r["impl"]: r for r in runner.run(tasks, "test")}
    assert rows["delta-attn torch"]["status"] == "ok"
    assert rows["cuDNN (SDPA)"]["status"] == "unavailable" and "CUDA" in rows["cuDNN (SDPA)"]["note"]
    assert "not installed: pip install fla-core" in rows["FLA parallel_attn"]["note"]
    if "delta-attn cudnn" in rows:
        assert rows["delta-attn cudnn"]["status"] == "unavailable" and rows["delta-attn cudnn"]["note"]


def test_crossover_point_is_log_interpolated():
    quad = {1024: 1.0, 2048: 4.0, 4096: 16.0}
    lin = {1024: 4.0, 2048: 4.0, 4096: 4.0}     # ratio 4, 1, 0.25: equal at 2048 exactly
    x, _ = report.crossover_point(lin, quad)
    assert x == pytest.approx(2048)
    lin = {1024: 2.0, 2048: 2.0, 4096: 2.0}     # ratio 2 then 0.5 -> geometric midpoint of 1024 and 2048
    x, how = report.crossover_point(lin, quad)
    assert x == pytest.approx(math.sqrt(1024 * 2048)) and "1024" in how
    assert report.crossover_point({1024: 9.0}, {1024: 1.0})[0] is None
    assert report.crossover_point({1024: 0.5}, {1024: 1.0})[0] == 1024


def test_flop_and_byte_models():
    assert models.visible_pairs(5, 5, causal=False) == 25
    assert models.visible_pairs(5, 5, causal=True) == 15
    assert models.visible_pairs(3, 5, causal=True) == 3 + 4 + 5      # bottom-right aligned
    assert models.visible_pairs(6, 6, False, window=(1, 0)) == 11
    # ANCHORS.md: 4 B H S^2 D forward, halved for causal (up to the diagonal), bwd 2.5x
    f = models.attention_flops(2, 16, 4096, 4096, 128, causal=False)
    assert f == 4 * 2 * 16 * 4096 ** 2 * 128
    assert models.attention_flops(2, 16, 4096, 4096, 128, causal=True, direction="fwd+bwd") == pytest.approx(
        3.5 * f / 2, rel=1e-3)
    x = torch.zeros(4, 8, dtype=torch.float16)
    assert models.io_bytes([x, x], x, [x], "fwd") == 3 * 64
    assert models.io_bytes([x, x], x, [x], "fwd+bwd") == 3 * 64 + 4 * 64
    # gradients added into existing .grad: one more read of the new gradient, a read and a write of the sum
    assert models.io_bytes([x, x], x, [x], "fwd+bwd", accumulate=True) == 3 * 64 + 7 * 64


@pytest.mark.parametrize("grads", ["accumulate", "fresh"])
def test_backward_rows_accumulate_or_reset_gradients(grads):
    # accumulate (do_bench's default, ANCHORS.md's protocol): .grad survives between timed calls and
    # the sum grows; fresh: reset before every call, so it holds one call's gradient
    s = Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=4, max_reps=4,
                 grads=grads)
    runner = Runner(s, {"copy_gbps": 1.0})
    case = dict(op="diag", B=1, S=9, H=2, D=4)
    seen = []
    impl = _fake("right", lambda o: o)
    bind = impl.bind

    def spy(case_, t):
        b = bind(case_, t)
        fn = b.fn

        def call():
            seen.append(None if b.leaves[0].grad is None else b.leaves[0].grad.abs().sum().item())
            return fn()
        return Bound(fn=call, leaves=b.leaves, spec=b.spec, inputs=b.inputs)
    impl = Impl(impl.name, impl.op, impl.family, impl.provider, spy, impl.why_not)
    rows = runner.run([Task("kernels", case, impl, ("fwd+bwd",), torch.float32)], "test")
    assert rows[0]["status"] == "ok", rows[0]["note"]
    timed = seen[-4:]
    if grads == "fresh":
        assert all(v is None for v in timed)
    else:
        assert all(v is not None for v in timed) and timed[0] < timed[1] < timed[2] < timed[3]
    md = report.markdown({"suite": "kernels", "settings": s.as_dict()}, rows, [])
    assert ("do_bench protocol" in md) == (grads == "accumulate")
    with pytest.raises(ValueError, match="grads"):
        Settings(grads="reset")


def test_timer_statistics_and_protocol():
    t = summarize([3.0, 1.0, 2.0, 10.0])
    assert t.median_ms == 2.5 and t.min_ms == 1.0 and t.reps == 4 and t.p20_ms < t.median_ms < t.p80_ms
    calls = []
    before = []
    timing = measure(lambda: calls.append(1), torch.device("cpu"), warmup_ms=0, rep_ms=0, min_reps=5,
                     before=lambda: before.append(1))
    assert timing.reps == 5 and len(calls) == 5 and len(before) == 5


def test_cli_rejects_unknown_suite(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "nonsense"])


def test_time_budget_skips_rows_not_started():
    s = Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=1, max_reps=1,
                 time_budget_s=1.0)
    runner = Runner(s, {})
    runner.deadline = 0.0           # already past
    case = dict(op="diag", B=1, S=9, H=2, D=4)
    rows = runner.run([Task("kernels", case, _fake("right", lambda o: o), ("fwd",), torch.float32)], "test")
    assert rows[0]["status"] == "skipped" and "time budget" in rows[0]["note"] and rows[0]["ms"] is None
