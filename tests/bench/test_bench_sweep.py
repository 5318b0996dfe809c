"""delta_attn.bench.sweep: real gated diagonal tile configurations (Triton interpreter on CPU) gated and
timed through the runner; a wrong candidate is FAILED with no time; backward directions need autograd."""
import torch

import delta_attn as da
from delta_attn.bench.runner import Settings
from delta_attn.bench.sweep import sweep
from delta_attn.ops.diag import launch as ti

SPEED_KEYS = ("ms", "ms_mean", "ms_std", "gbps", "frac_copy", "tokens_per_s")
CASE = dict(op="diag", B=1, S=32, H=2, D=16)


def _settings():
    return Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=1, max_reps=1)


def _forward(cfg, shift=0.0):
    return lambda q, k, v, g: ti.diag_fwd(q, k, v, g, config=cfg)[0] + shift


def test_sweep_gates_then_times_each_config():
    configs = [ti.FwdConfig(8, 16, 2, 2, split=2), ti.FwdConfig(16, 16, 2, 4, split=4)]
    candidates = {str(c): _forward(c) for c in configs}
    candidates["wrong"] = _forward(configs[0], shift=0.01)
    rows = sweep(CASE, candidates, _settings(), dtype="fp32", ceilings={"copy_gbps": 1.0})
    assert [r.impl for r in rows] == list(candidates)
    for r in rows[:-1]:
        assert r.suite == "sweep" and r.op == "diag" and r.direction == "fwd"
        assert r.status == "ok", r.note
        assert r.gate["ok"] and r.ms > 0 and r.frac_copy > 0
        assert r.bytes == 5 * 32 * 2 * 16 * 4        # q, k, v, g read, o written, fp32
    wrong = rows[-1]
    assert wrong.status == "FAILED" and wrong.note.startswith("correctness gate")
    assert all(getattr(wrong, k) is None for k in SPEED_KEYS)


def test_backward_directions_need_a_differentiable_candidate():
    candidates = {"default (autograd)": lambda q, k, v, g: da.gated_diag_attn(q, k, v, g, backend="triton")[0],
                  "forward only": _forward(ti.FWD_CONFIG)}
    rows = sweep(CASE, candidates, _settings(), directions=("fwd+bwd",), dtype="fp32")   # ceilings measured
    by = {r.impl: r for r in rows}
    ok = by["default (autograd)"]
    assert ok.status == "ok", ok.note
    assert ok.gate["ok"] and ok.ms > 0 and ok.frac_copy > 0
    assert by["forward only"].status == "FAILED" and by["forward only"].ms is None
