"""``delta-attn bench scaling`` on 2 gloo ranks at toy sizes: every row runs, passes its correctness
probe and gets its times, efficiency and communication time; rank 0 alone writes the report."""
import json
import os

import pytest
import torch

from distributed_harness import run_ranks


def _scaling_body(rank, world, out):
    from delta_attn import cli
    import delta_attn.distributed as dd
    assert cli.main(["bench", "scaling", "--device", "cpu", "--tiny", "--dtype", "fp32", "--out", out]) == 0
    if rank != 0:
        return
    with open(os.path.join(out, "results.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    run, rows = recs[0], recs[1:]
    assert run["record"] == "run" and run["world_size"] == world and run["backend"] == "gloo"
    ops = {"kda", "diag"} | ({"flash"} if hasattr(dd, "flash_attn_func") else set())
    assert {r["op"] for r in rows} == ops
    for op in ("kda", "diag"):          # both state-passing schemes, weak and strong, fwd and fwd+bwd
        got = {(r["mode"], r["state_passing"], r["direction"]) for r in rows if r["op"] == op}
        assert got == {(m, sp, d) for m in ("weak", "strong") for sp in ("allgather", "ring")
                       for d in ("fwd", "fwd+bwd")}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["tokens_total"] == (16 * world if r["mode"] == "weak" else 48)
        assert r["tokens_per_gpu"] * world == r["tokens_total"]
        for key in ("ms", "local_ms", "comm_ms", "one_gpu_ms", "tokens_per_s", "efficiency"):
            assert r[key] is not None and r[key] > 0, (key, r)
        assert abs(r["efficiency"] - r["tokens_per_s"] / (world * r["one_gpu_tokens_per_s"])) < 1e-9
        # against one GPU's time on all the work / N: for linear work the efficiency itself; attention (weak,
        # quadratic work) against the single-GPU operator measured at T_total (it fits at toy sizes)
        assert abs(r["efficiency_vs_ideal"] - r["ideal_ms"] / r["ms"]) < 1e-9
        want = "measured" if r["mode"] == "strong" or r["op"] == "flash" else "linear"
        assert r["ideal_source"] == want, r
        if want == "linear":
            assert abs(r["efficiency_vs_ideal"] - r["efficiency"]) < 1e-9
        assert r["peak_mib"] is None and r["local_peak_mib"] is None       # CUDA only
    report = open(os.path.join(out, "report.md")).read()
    assert "| kda | weak | allgather |" in report and "efficiency" in report and "vs ideal" in report


def test_scaling_suite_runs_on_two_gloo_ranks(tmp_path):
    run_ranks(2, _scaling_body, str(tmp_path / "scaling"))


def _oom_body(rank, world):
    """A rank that runs out of memory on the single-GPU operator skips the row, and so do the others (no rank
    is left waiting in a collective of the context-parallel call)."""
    from delta_attn.bench import scaling
    from delta_attn.bench.runner import Settings

    def single_that_runs_out_on_rank_1():
        if rank == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
    device = torch.device("cpu")
    assert scaling._fits_on_every_rank(lambda: None, device)
    assert not scaling._fits_on_every_rank(single_that_runs_out_on_rank_1, device)
    s = Settings(device="cpu", tiny=True, dtypes=("fp32",))
    c = [x for x in scaling.cases(s, world) if x["op"] == "diag" and x["mode"] == "weak"][0]
    real = scaling._calls

    def calls(op, sp, dev):
        single, parallel, layout = real(op, sp, dev)

        def single_oom(*a, **k):
            if rank == 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return single(*a, **k)
        return single_oom, parallel, layout
    scaling._calls = calls
    try:
        row = scaling._measure_row(c, "allgather", torch.float32, "fwd", device, s, world)
    finally:
        scaling._calls = real
    assert row["status"] == "skipped" and "out of memory" in row["note"], row


def test_out_of_memory_on_one_rank_skips_the_row_on_every_rank():
    run_ranks(2, _oom_body)


def test_scaling_cases_divide():
    from delta_attn.bench.runner import Settings
    from delta_attn.bench.scaling import cases
    s = Settings(device="cpu", tokens=1 << 20)
    for world in (1, 2, 4, 8):
        cs = cases(s, world)
        strong = [c for c in cs if c["mode"] == "strong"]
        assert all(c["T_local"] * world == 1 << 20 and "skip" not in c for c in strong)
    assert all("skip" in c for c in cases(Settings(device="cpu", tokens=1000), 3) if c["mode"] == "strong")
    with pytest.raises(SystemExit):        # the CLI refuses an unknown suite before anything runs
        from delta_attn import cli
        cli.main(["bench", "scalling"])
