"""delta-attn bench: the tiny CPU crossover end to end, report re-rendering and --compare, the
correctness gate (a wrong implementation is FAILED with no speed), missing peers, and the models."""
import json
import math
import os
import shutil

import pytest
import torch

from delta_attn import cli
from delta_attn.bench import cases, crossover, impls, models, report, results_files, text
from delta_attn.bench.impls import Bound, Impl
from delta_attn.bench.runner import Runner, Settings, Task
from delta_attn.bench.timer import measure, summarize

ROW_KEYS = {"record", "suite", "op", "impl", "provider", "family", "direction", "dtype", "label", "case", "tokens",
            "status", "note", "ms", "ms_mean", "ms_std", "ms_p20", "ms_p80", "ms_min", "reps", "first_call_ms",
            "flops", "tflops", "frac_gemm", "bytes", "gbps", "frac_copy", "tokens_per_s", "peak_mem_mb", "gate"}
SPEED_KEYS = ("ms", "ms_mean", "ms_std", "tflops", "gbps", "tokens_per_s")


@pytest.fixture(scope="module")
def crossover_dir(tmp_path_factory):
    """The tiny CPU crossover end to end, with the reference rows and the peers (each unavailable on a CPU, with its
    reason). Its Triton-interpreter rows take a minute; test_triton_rows_pass_the_gate_on_the_interpreter runs one
    case of each instead."""
    out = str(tmp_path_factory.mktemp("bench") / "crossover")
    assert cli.main(["bench", "crossover", "--device", "cpu", "--tiny", "--impls", "torch", "cudnn", "fla",
                     "--out", out]) == 0
    return out


def _read(out):
    return results_files.read_jsonl(os.path.join(out, "results.jsonl"))


def test_crossover_tiny_writes_every_artifact(crossover_dir):
    for name in ("results.jsonl", "results.csv", "report.md", "latency.png", "throughput.png"):
        path = os.path.join(crossover_dir, name)
        assert os.path.getsize(path) > 0, name
    with open(os.path.join(crossover_dir, "latency.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    run, rows = _read(crossover_dir)
    assert run["record"] == "run" and run["schema"] == results_files.SCHEMA_VERSION and run["suite"] == "crossover"
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
    for part in ("## Environment", "## Ceilings", "Latency, fwd+bwd", "## Rows that did not run",
                 "delta-attn torch [kda]", "![latency.png](latency.png)"):
        assert part in md, part


@pytest.mark.parametrize("op", ["flash", "kda", "diag"])
def test_triton_rows_pass_the_gate_on_the_interpreter(op):
    s = Settings(device="cpu", tiny=True, dtypes=("fp16",), warmup_ms=0, rep_ms=0, min_reps=1, max_reps=1)
    impl = next(i for i in impls.catalogue(op, torch.device("cpu")) if i.name == "delta-attn triton")
    case = {"op": op, "B": 2, "S": 16, "H": 2, "D": 16, **({"Hk": 2, "causal": True} if op == "flash" else {})}
    rows = Runner(s, {"copy_gbps": 1.0, "gemm_tflops": 1.0}).run(
        [Task("crossover", case, impl, ("fwd", "fwd+bwd"), torch.float16)], "test")
    assert [(r.direction, r.status) for r in rows] == [("fwd", "ok"), ("fwd+bwd", "ok")], [r.note for r in rows]
    assert all(r.ms > 0 and r.gate["ok"] for r in rows)


def test_tiny_crossover_is_a_smoke_test_that_claims_no_crossover(crossover_dir):
    """One timed call per row at toy sizes says nothing about speed: the report says so, names the CPU timer
    it used, and makes no crossover or speed-up claim (no "faster at every measured length" beside a slower
    ratio)."""
    run, rows = _read(crossover_dir)
    md = open(os.path.join(crossover_dir, "report.md")).read()
    assert "**Smoke test**" in md and "claims no crossover" in md
    for claim in ("## The answer", "Crossover, fwd", "Complete comparison", "faster at every", "crossover S",
                  "x at S =", "speed-up at"):
        assert claim not in md, claim
    assert "crossover" not in run                  # no crossover points as data either
    smoke = md.split("## Smoke test")[1].split("## Environment")[0]
    for line in smoke.splitlines():
        if line.startswith("| ") and "---" not in line and not line.startswith("| linear operator"):
            assert all(c.strip().startswith(("ran at S = ", "not timed (")) for c in line.split("|")[2:-1]), line
    method = md.split("## How this was measured")[1]
    assert "CUDA events" not in method and "L2" not in method
    assert "single call timed with the CPU wall clock (`time.perf_counter`)" in method
    assert {r["reps"] for r in rows if r["status"] == "ok"} == {1}


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
    results_files.write_jsonl(os.path.join(old, "results.jsonl"), run, rows)
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
    by = {(r.impl, r.direction): r for r in rows}
    assert by[("right", "fwd")].status == "ok" and by[("right", "fwd+bwd")].status == "ok"
    assert by[("right", "fwd")].ms > 0
    for name in ("wrong", "nan", "boom"):
        for d in ("fwd", "fwd+bwd"):
            r = by[(name, d)]
            assert r.status == "FAILED", (name, d, r.note)
            assert all(getattr(r, k) is None for k in SPEED_KEYS)
            assert r.note.startswith("correctness gate")
    assert "kernel exploded" in by[("boom", "fwd")].note
    md = report.markdown({"suite": "kernels"}, [r.to_json() for r in rows], [])
    assert "**FAILED**" in md


def test_unavailable_backend_row_carries_the_registry_reason(monkeypatch):
    monkeypatch.setattr(impls, "package_available", lambda m: False)
    s = Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=1, max_reps=1)
    runner = Runner(s, {})
    case = dict(op="flash", B=1, S=8, H=2, Hk=2, D=8, causal=True)
    tasks = [Task("kernels", case, i, ("fwd",), torch.float32) for i in impls.catalogue("flash", torch.device("cpu"))]
    rows = {r.impl: r for r in runner.run(tasks, "test")}
    assert rows["delta-attn torch"].status == "ok"
    assert rows["cuDNN (SDPA)"].status == "unavailable" and "CUDA" in rows["cuDNN (SDPA)"].note
    assert "not installed: pip install fla-core" in rows["FLA parallel_attn"].note
    if "delta-attn cudnn" in rows:
        assert rows["delta-attn cudnn"].status == "unavailable" and rows["delta-attn cudnn"].note


def test_crossover_point_is_log_interpolated():
    quad = {1024: 1.0, 2048: 4.0, 4096: 16.0}
    lin = {1024: 4.0, 2048: 4.0, 4096: 4.0}     # ratio 4, 1, 0.25: equal at 2048 exactly
    x, _ = crossover.crossover_point(lin, quad)
    assert x == pytest.approx(2048)
    lin = {1024: 2.0, 2048: 2.0, 4096: 2.0}     # ratio 2 then 0.5 -> geometric midpoint of 1024 and 2048
    x, how = crossover.crossover_point(lin, quad)
    assert x == pytest.approx(math.sqrt(1024 * 2048)) and "1024" in how
    assert crossover.crossover_point({1024: 9.0}, {1024: 1.0})[0] is None
    assert crossover.crossover_point({1024: 0.5}, {1024: 1.0})[0] == 1024


def test_flop_and_byte_models():
    assert models.visible_pairs(5, 5, causal=False) == 25
    assert models.visible_pairs(5, 5, causal=True) == 15
    assert models.visible_pairs(3, 5, causal=True) == 3 + 4 + 5      # bottom-right aligned
    assert models.visible_pairs(6, 6, False, window=(1, 0)) == 11
    # docs/PEERS.md: 4 B H S^2 D forward, halved for causal (up to the diagonal), bwd 2.5x
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
    # accumulate (do_bench's default, the protocol of docs/PEERS.md): .grad survives between timed calls and
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
    assert rows[0].status == "ok", rows[0].note
    timed = seen[-4:]
    if grads == "fresh":
        assert all(v is None for v in timed)
    else:
        assert all(v is not None for v in timed) and timed[0] < timed[1] < timed[2] < timed[3]
    md = report.markdown({"suite": "kernels", "settings": s.as_dict()}, [r.to_json() for r in rows], [])
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
    assert rows[0].status == "skipped" and "time budget" in rows[0].note and rows[0].ms is None


# ------------------------------------------------------------------ the crossover is always answered

def test_coarse_to_fine_brackets_first():
    from delta_attn.bench.suites import coarse_to_fine
    ks = [1024 * 2 ** i for i in range(8)]
    assert coarse_to_fine(ks) == [1024, 131072, 8192, 2048, 32768, 4096, 16384, 65536]
    assert sorted(coarse_to_fine(ks)) == ks
    assert coarse_to_fine([4, 2]) == [2, 4] and coarse_to_fine([]) == []


def test_crossover_order_puts_the_answer_first():
    from delta_attn.bench import suites
    s = Settings(device="cpu", dtypes=("bf16",), max_seq=16384, max_linear_seq=65536)
    tasks = suites.crossover(s)
    fla = [i for i, t in enumerate(tasks) if t.impl.provider == "fla-core"]
    fast = [i for i, t in enumerate(tasks) if t.impl.provider != "fla-core"]
    assert fla and fast and max(fast) < min(fla)        # FLA's minutes of autotuning come last
    # FLA's forward rows at every length before any of its backward autotuning
    fla_dirs = [tasks[i].directions for i in fla]
    assert all(len(d) == 1 for d in fla_dirs)
    assert max(i for i, d in enumerate(fla_dirs) if d == ("fwd",)) < fla_dirs.index(("fwd+bwd",))
    shared = {1024, 2048, 4096, 8192, 16384}
    passes = [[tasks[i] for i in fast]] + [[tasks[i] for i in fla if tasks[i].directions == (d,)]
                                           for d in ("fwd", "fwd+bwd")]
    for group in passes:
        lengths = [t.case["S"] for t in group]
        first_linear_only = next(i for i, S in enumerate(lengths) if S not in shared)
        assert all(S in shared for S in lengths[:first_linear_only])
        assert all(S not in shared for S in lengths[first_linear_only:])
        seen = list(dict.fromkeys(lengths))
        assert seen[:3] == [1024, 16384, 4096]
        # at each length every quadratic row comes before the linear ones
        for S in shared:
            fams = [t.impl.family for t in group if t.case["S"] == S]
            if "quadratic" in fams and "linear" in fams:
                assert max(i for i, f in enumerate(fams) if f == "quadratic") < fams.index("linear")


def _sleepy(name, first_call_s):
    """A diag implementation whose first call takes ``first_call_s`` seconds (a peer that autotunes)."""
    import time as _time
    impl = _fake(name, lambda o: o)
    bind, calls = impl.bind, []

    def slow_bind(case, t):
        b = impl_bind_inner(case, t)
        fn = b.fn

        def call():
            if not calls:
                calls.append(1)
                _time.sleep(first_call_s)
            return fn()
        return Bound(fn=call, leaves=b.leaves, spec=b.spec, inputs=b.inputs)
    impl_bind_inner = bind
    return Impl(name, impl.op, impl.family, "fla-core", slow_bind, impl.why_not)


def test_first_call_limit_stops_a_slow_peer_and_skips_its_later_rows():
    s = Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=1, max_reps=1,
                 first_call_limit_s=4.0)       # rows of the good implementation take well under this
    runner = Runner(s, {})
    slow, good = _sleepy("autotuner", 30.0), _fake("right", lambda o: o)
    tasks = [Task("crossover", dict(op="diag", B=1, S=S, H=2, D=4), impl, ("fwd",), torch.float32)
             for S in (8, 16) for impl in (slow, good)]
    import time as _time
    t0 = _time.perf_counter()
    rows = runner.run(tasks, "test")
    assert _time.perf_counter() - t0 < 25
    by = {(r.impl, r.case["S"]): r for r in rows}
    first = by[("autotuner", 8)]
    assert first.status == "skipped" and "--first-call-limit" in first.note and first.ms is None
    later = by[("autotuner", 16)]
    assert later.status == "skipped" and "later rows are skipped" in later.note
    assert by[("right", 8)].status == "ok" and by[("right", 16)].status == "ok"
    md = report.markdown({"suite": "crossover"}, [r.to_json() for r in rows], [])
    assert "rows stopped by --first-call-limit" in md


def test_a_row_running_when_the_budget_ends_is_stopped():
    s = Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=1, max_reps=1,
                 time_budget_s=0.5)
    runner = Runner(s, {})
    import time as _time
    runner.deadline = _time.perf_counter() + 0.5
    rows = runner.run([Task("crossover", dict(op="diag", B=1, S=8, H=2, D=4), _sleepy("autotuner", 30.0), ("fwd",),
                            torch.float32)], "test")
    assert rows[0].status == "skipped" and "time budget" in rows[0].note


def _xrow(impl, op, family, S, ms, direction="fwd", provider="delta-attn", status="ok", note="", first=None):
    return {"suite": "crossover", "impl": impl, "op": op, "family": family, "provider": provider, "direction": direction,
            "dtype": "bf16", "case": {"S": S, "B": max(1, 65536 // S)}, "status": status, "note": note,
            "ms": ms if status == "ok" else None, "first_call_ms": first, "label": f"S={S}"}


def test_answer_section_gives_every_linear_operator_a_crossover_or_a_reason():
    K = 1024
    rows = []
    for S, q in ((K, 1.0), (8 * K, 8.0), (128 * K, 128.0)):
        rows.append(_xrow("cuDNN (SDPA)", "flash", "quadratic", S, q, provider="torch"))
        rows.append(_xrow("slow quad", "flash", "quadratic", S, 2 * q, provider="torch"))
        rows.append(_xrow("delta-attn triton", "kda", "linear", S, 4.0, first=15000.0))      # crosses at 4K
        rows.append(_xrow("delta-attn triton", "diag", "linear", S, 0.5))                      # always faster
        rows.append(_xrow("peer", "kda", "linear", S, 1000.0, provider="fla-core"))            # never
    rows.append(_xrow("FLA chunk_kda", "kda", "linear", K, None, provider="fla-core", status="skipped",
                      note="stopped after 120 s: the first call ran past the 120 s limit (--first-call-limit)"))
    md = crossover.answer_section(rows)
    lines = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in md.splitlines() if line.startswith("| ") and "---" not in line}
    assert lines["delta-attn triton [kda]"][0] == "4K" and lines["delta-attn triton [kda]"][1] == "32x"
    assert lines["delta-attn triton [kda]"][2] == "15.0 s"
    assert lines["delta-attn triton [diag]"][0] == "≤ 1K" and lines["delta-attn triton [diag]"][1] == "256x"
    assert lines["peer [kda]"][0] == "> 128K"
    assert lines["FLA chunk_kda [kda]"][0].startswith("not timed (skipped: stopped after 120 s")
    assert "Fastest quadratic implementation at S = 128K: fwd: cuDNN (SDPA), 128 ms" in md
    # ours first, KDA before diagonal
    names = [n for n in lines if n != "linear operator"]
    assert names.index("delta-attn triton [kda]") < names.index("peer [kda]") < names.index("delta-attn triton [diag]")


@pytest.mark.parametrize("budget", ["0.5", "30"])
def test_any_budget_still_answers(tmp_path, budget):
    out = str(tmp_path / "x")
    assert cli.main(["bench", "crossover", "--device", "cpu", "--tiny", "--out", out, "--no-plots",
                     "--time-budget", budget, "--impls", "torch"]) == 0
    run, rows = _read(out)
    md = open(os.path.join(out, "report.md")).read()
    answer = md.split("## Smoke test")[1].split("## Environment")[0]
    timed = {(r["impl"], r["op"]) for r in rows if r["family"] == "linear" and r["status"] == "ok"}
    if budget == "0.5":       # far too small: rows were skipped, and the report still says so per operator
        assert any(r["status"] == "skipped" and "time budget" in r["note"] for r in rows)
    else:
        assert timed
    for impl, op in timed:    # every linear operator timed says where it ran
        line = next(x for x in answer.splitlines() if x.startswith(f"| {impl} [{op}]"))
        assert line.split("|")[2].strip().startswith(("ran at S = ", "not timed (")), line
    for r in rows:
        if r["family"] == "linear" and (r["impl"], r["op"]) not in timed and r["impl"] + " [" in answer:
            assert f"| {r['impl']} [{r['op']}] | not timed (" in answer


CUDNN_NOTE = ("cudnn not installed — pip install --no-deps 'nvidia-cudnn-frontend>=1.32' and pip install cuda-python "
              "(the sm_90 KDA engine compiles with NVRTC and needs the CUDA headers); runs on cuda tensors, got cpu")


def _budget_cut_rows():
    """A GPU crossover cut short by a small --time-budget: attention timed at 1K only (its 8K row stopped by the
    budget), a linear operator timed only at a linear-only length, one never timed (unavailable, a long note),
    one whose ratio dips below 1 at 1K and comes back above it at 8K."""
    K = 1024
    rows = [_xrow("cuDNN (SDPA)", "flash", "quadratic", K, 1.0, provider="torch"),
            _xrow("cuDNN (SDPA)", "flash", "quadratic", 8 * K, None, provider="torch", status="skipped",
                  note="stopped after 3 s: the suite time budget of 20 s ended"),
            _xrow("delta-attn triton", "kda", "linear", K, 0.5), _xrow("delta-attn triton", "kda", "linear", 8 * K, 9.0),
            _xrow("late", "kda", "linear", 256 * K, 2.0),
            _xrow("late", "kda", "linear", K, None, status="skipped", note="suite time budget of 20 s reached"),
            _xrow("delta-attn cudnn", "kda", "linear", K, None, status="unavailable", note=CUDNN_NOTE)]
    rows += [_xrow("cuDNN (SDPA)", "flash", "quadratic", 8 * K, 4.0, provider="torch", direction="fwd+bwd"),
             _xrow("delta-attn triton", "kda", "linear", K, 0.5, direction="fwd+bwd"),
             _xrow("delta-attn triton", "kda", "linear", 8 * K, 9.0, direction="fwd+bwd")]
    for i, r in enumerate(rows):      # what a timed row also carries
        r.update(ms_p20=r["ms"], ms_p80=r["ms"], tokens_per_s=65536.0, reps=(10, 100)[i % 2] if r["ms"] else None)
    return rows


def test_a_budget_cut_crossover_says_a_length_or_why_not_and_never_contradicts_itself():
    run = {"suite": "crossover", "settings": {"device": "cuda", "warmup_ms": 25.0}}
    md = report.markdown(run, _budget_cut_rows(), [])
    assert "no common measured length" not in md
    verdicts = {}
    for section in ("## The answer", "**Crossover, fwd, bf16**", "**Crossover, fwd+bwd, bf16**"):
        table = md.split(section)[1].split("\n\n")[1 if section != "## The answer" else 3]
        for line in table.splitlines()[2:]:
            cells = [c.strip() for c in line.split("|")[1:-1]]
            verdicts[(section, cells[0])] = cells
            assert cells[1].startswith(("≤", ">", "not timed (")) or cells[1][0].isdigit(), line
    answer = {name: cells for (sec, name), cells in verdicts.items() if sec == "## The answer"}
    # faster at 1K, slower at 8K: not "faster at every measured length", and the speed-up agrees
    assert answer["delta-attn triton [kda]"][1] == "≤ 1K"             # fwd: 8K has no attention time
    assert answer["delta-attn triton [kda]"][3] == "not timed at 128K (2x at 1K)"
    assert answer["delta-attn triton [kda]"][2] == "> 8K"             # fwd+bwd: 2.25x the time at 8K
    where = verdicts[("**Crossover, fwd+bwd, bf16**", "delta-attn triton [kda]")]
    assert where[2] == "not reached up to S = 8192 (still 2.25x the time)" and where[3] == "0.444x at S = 8192"
    assert answer["late [kda]"][1] == "not timed (at no length where attention was: this operator ran at S = 262144, " \
                                      "attention at S = 1024)"
    assert answer["late [kda]"][2].startswith("not timed (")
    # the whole install hint, never cut
    assert answer["delta-attn cudnn [kda]"][1] == f"not timed (unavailable: {CUDNN_NOTE})"
    assert f"not timed (unavailable: {CUDNN_NOTE})" in md.split("**Crossover, fwd, bf16**")[1]
    method = md.split("## How this was measured")[1]
    assert "CUDA events" in method and "L2 cache flushed" in method and "median of 10 to 100 timed calls" in method


def test_crossover_is_where_the_linear_op_stays_faster():
    quad = {16: 1.0, 32: 1.0, 64: 1.0, 128: 1.0}
    x, how = crossover.crossover_point({16: 0.5, 32: 2.0, 64: 0.5, 128: 0.25}, quad)
    assert 32 < x < 64 and how == "between S = 32 and 64 (also faster at S = 16, slower again at S = 32)"
    x, how = crossover.crossover_point({16: 0.5, 32: 2.0}, {16: 1.0, 32: 1.0})
    assert x is None and how == "not reached up to S = 32 (still 2x the time; faster at S = 16 only)"
    assert crossover.crossover_text(x, how) == "> 32"


def test_rates_keep_their_digits():
    assert text.rate(0.05e12, "FLOP/s") == "50 GFLOP/s"
    assert text.rate(4247e9, "B/s") == "4.25 TB/s"
    assert text.rate(None, "B/s") == "-"
    md = report.ceilings_block({"ceilings": {"copy_gbps": 20.0, "gemm_tflops": 0.04}})
    assert "40 GFLOP/s" in md and "20 GB/s" in md


def test_decode_section_shows_graph_replay_beside_eager():
    row = {"suite": "decode", "op": "kda_decode", "impl": "delta-attn triton", "status": "ok", "dtype": "bf16",
           "case": {"B": 64, "H": 16, "D": 128}, "ms": 0.060, "graph_ms": 0.040, "graph_note": "",
           "bytes": 134e6, "tokens": 64}
    peer = dict(row, impl="peer", graph_ms=None, graph_note="not capturable: RuntimeError: sync")
    md = report.decode_section([row, peer], {"copy_gbps": 4000.0})
    line = next(x for x in md.splitlines() if "delta-attn triton" in x)
    assert "| 60 | 40 |" in line and "3.35 TB/s" in line and "84%" in line
    assert "not capturable" in next(x for x in md.splitlines() if "| peer |" in x)


def test_bench_all_writes_a_top_level_report(crossover_dir, tmp_path):
    root = tmp_path / "all"
    shutil.copytree(crossover_dir, root / "crossover")
    path = report.write_index(str(root), "delta-attn bench all")
    md = open(path).read()
    assert "[crossover/report.md](crossover/report.md)" in md and "linear operator" in md


def test_kernels_suite_runs_the_slow_starters_last_one_direction_at_a_time():
    from delta_attn.bench import suites
    tasks = suites.kernels(Settings(device="cpu", dtypes=("bf16",)))
    slow = [i for i, t in enumerate(tasks) if t.impl.provider == "fla-core"]
    assert slow and min(slow) == len(tasks) - len(slow)
    dirs = [tasks[i].directions for i in slow]
    assert all(len(d) == 1 for d in dirs) and dirs.index(("fwd+bwd",)) > max(
        i for i, d in enumerate(dirs) if d == ("fwd",))
    # nothing lost: every (impl, case, direction) of the plain order is still there once
    key = lambda t, d: (t.impl.name, str(t.case), d)
    assert sorted(key(t, d) for t in tasks for d in t.directions) == sorted(
        set(key(t, d) for t in tasks for d in t.directions))


WATCHDOG_SCRIPT = r"""
import signal, sys, time, torch
import delta_attn.bench as B
from delta_attn.bench import suites
from delta_attn.bench.impls import Bound, Impl
from delta_attn.bench.runner import Settings, Task

def bind(case, t):
    x = t["q"].detach().requires_grad_(False)
    def stuck():                       # native code that no signal interrupts: SIGALRM blocked
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(60)
        return x
    return Bound(fn=stuck, leaves=[], spec=lambda L, up: x, inputs=[x])

impl = Impl("stuck peer", "diag", "linear", "fla-core", bind, lambda c, d, t, g: None)
suites.build = lambda suite, s, **kw: [Task("crossover", dict(op="diag", B=1, S=8, H=2, D=4), impl, ("fwd",),
                                            torch.float32)]
B.WATCHDOG_GRACE_S = 1.0
# the budget counts from the run's start: the ceilings (seconds on a loaded CPU) must not use it all up, or the
# row is skipped before it starts and nothing gets stuck
s = Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=1, max_reps=1,
             time_budget_s=8.0, gate=False)
B.run_suite("crossover", s, sys.argv[1], plots=False)
print("NOT REACHED")
"""


def test_watchdog_ends_a_run_stuck_in_native_code(tmp_path):
    import subprocess
    import sys
    import time as _time
    out = str(tmp_path / "stuck")
    t0 = _time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WATCHDOG_SCRIPT, out], capture_output=True, text=True, timeout=120)
    took = _time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "NOT REACHED" not in proc.stdout and "stopped the process" in proc.stderr
    assert took < 45        # budget 8 s + grace 1 s + start-up and report, not the 60 s sleep
    run, rows = _read(out)
    assert run["interrupted"] and "ended" in run["stopped"] and run["duration_s"] < 30
    assert rows[-1]["status"] == "skipped" and rows[-1]["note"].startswith("abandoned")
    assert os.path.exists(os.path.join(out, "report.md"))


@pytest.mark.parametrize("field, value", [("first_call_limit_s", -1.0), ("time_budget_s", float("nan")),
                                          ("rep_ms", -5.0), ("resources", "everything")])
def test_settings_refuse_values_that_would_mean_something_else(field, value):
    with pytest.raises(ValueError, match=field.split("_s")[0] if field != "resources" else "resources"):
        Settings(**{field: value})
    s = Settings(device="cpu", tiny=True)
    setattr(s, field, value)            # the CLI sets fields after construction: run_suite checks again
    from delta_attn.bench import run_suite
    with pytest.raises(ValueError, match=field if field != "resources" else "resources"):
        run_suite("ceilings", s, "/tmp/never-written")
