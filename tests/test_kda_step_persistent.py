"""The persistent KDA decode step experiment (benchmarks/kda_step_persistent.py) on CPU under the interpreter
(fp32, fp16), against the float64 reference (DESIGN.md's error rule, outputs poisoned).

Each case steps T tokens of B sequences from a pool with one pipeline mode of the item loop (none, manual
prefetch, Triton's pipeliner) over a grid smaller than the item count (4 programs on CPU, a ragged last round):
slot layouts IDX 0 / 1 / 2 (speculative, with and without ``num_accepted_tokens``), the three gate modes,
masked (K = 48, V = 48 in 16-column blocks) and unmasked (K = 16, V = 32) tiles. Expected: the reference run
token by token from each sequence's start slot; every written slot holds the state after its token, and the
slots outside the table are untouched.
"""
import importlib.util
import pathlib
import sys

import pytest
import torch

from delta_attn import reference
from delta_attn.testing import check, poison_outputs

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "kda_step_persistent.py"
_spec = importlib.util.spec_from_file_location("kda_step_persistent", _PATH)
exp = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exp)

DT = {"fp32": torch.float32, "fp16": torch.float16}
# (name, IDX, gate, K, V, BV): IDX 2 "nat" has num_accepted_tokens
CASES = [("idx0-raw-even", 0, None, 16, 32, None), ("idx1-softplus-dtbias", 1, "softplus", 48, 48, 16),
         ("idx2-nat-lower_bound", "2nat", "lower_bound", 48, 48, 16), ("idx2-softplus", 2, "softplus", 48, 48, 32)]


def _case(seed, B, T, H, HV, K, V, gate, dtype):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)     # noqa: E731
    if gate is None:    # raw log decays, a tenth of them resets
        g = torch.nn.functional.logsigmoid(rnd(B, T, HV, K) + 2.0)
        g = torch.where(torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) < 0.1, torch.full_like(g, -1e4), g)
    else:
        g = rnd(B, T, HV, K)
    xs = [rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V), g, torch.rand(B, T, HV, generator=gen,
                                                                               dtype=torch.float64)]
    opts = {}
    if gate is not None:
        opts["A_log"] = (rnd(HV) * 0.3).float()
    if gate == "softplus":
        opts["dt_bias"] = (rnd(HV * K) * 0.3).float()
    if gate == "lower_bound":
        opts["lower_bound"] = -5.0
    return [x.to(dtype) for x in xs], opts, gen


def _expected(xs, s0, n, opts, upcast):
    """Outputs of the first n tokens and the state after token n - 1 (reference, from start states s0)."""
    o, s = reference.kda(*[x[:, :n] for x in xs], initial_state=s0, output_final_state=True, use_qk_l2norm=True,
                         upcast=upcast, **opts)
    return o, s


@pytest.mark.parametrize("pipe,stages", [("none", 1), ("manual", 1), ("auto", 2)])
@pytest.mark.parametrize("name,idx_mode,gate,K,V,BV", CASES, ids=[c[0] for c in CASES])
def test_persistent_step_matches_the_reference(pipe, stages, name, idx_mode, gate, K, V, BV):
    B, T, H, HV = 3, 2, 1, 2
    dt = "fp16" if (len(name) + len(pipe)) % 2 else "fp32"
    dtype = DT[dt]
    xs, opts, gen = _case(sum(map(ord, name + pipe)), B, T, H, HV, K, V, gate, dtype)
    P = 2 * B * T + 1
    pool = (torch.randn(P, HV, K, V, generator=gen, dtype=torch.float64) * 0.5).float()
    perm = torch.randperm(P, generator=gen)
    nat = None
    if idx_mode == 0:
        slots, start = None, torch.arange(B)
    elif idx_mode == 1:
        slots = perm[:B].to(torch.int32)
        start = slots.long()
    else:
        slots = perm[:B * T].view(B, T).to(torch.int32)
        col = torch.zeros(B, dtype=torch.long)
        if idx_mode == "2nat":
            nat = torch.tensor([2, 1, 2][:B], dtype=torch.int32)
            col = nat.long() - 1
        start = slots.long()[torch.arange(B), col]
    before = pool.clone()
    s0 = before[start]
    scale = K ** -0.5
    variant = exp.Variant(per_sm=1, pipe=pipe, stages=stages, BV=BV)
    with poison_outputs():
        o = exp.persistent_step(*xs, pool, slots, opts.get("A_log"), opts.get("dt_bias"), scale,
                                opts.get("lower_bound"), True, nat, variant)
    xs64 = [x.double() for x in xs]
    o64, _ = _expected(xs64, s0.double(), T, opts, True)
    olow, _ = _expected(xs, s0, T, opts, False)
    v = check(o, o64, olow, name="o")
    assert v.ok, v.message
    # the slots written and what each must hold: the final state (IDX 0 / 1) or the state after each token
    written = {}
    if slots is None or slots.dim() == 1:
        written = {(b, T): int(start[b]) for b in range(B)}
    else:
        written = {(b, t + 1): int(slots[b, t]) for b in range(B) for t in range(T)}
    for (b, n), slot in written.items():
        _, s64 = _expected([x[b:b + 1] for x in xs64], s0[b:b + 1].double(), n, opts, True)
        _, slow = _expected([x[b:b + 1] for x in xs], s0[b:b + 1], n, opts, False)
        v = check(pool[slot], s64[0], slow[0], name=f"slot {slot} (sequence {b}, after {n} tokens)")
        assert v.ok, v.message
    untouched = sorted(set(range(P)) - set(written.values()))
    assert torch.equal(pool[untouched], before[untouched]), "a slot outside the table was written"


def test_bad_variant_and_strided_pool_are_named_errors():
    xs, _, _ = _case(1, 2, 1, 1, 2, 16, 16, None, torch.float32)
    pool = torch.zeros(2, 2, 16, 16)
    with pytest.raises(ValueError, match="variant.pipe must be one of"):
        exp.persistent_step(*xs, pool, None, None, None, 0.25, None, True, None, exp.Variant(pipe="fast"))
    strided = torch.zeros(2, 2, 16, 32)[..., :16]
    with pytest.raises(ValueError, match="state must be contiguous"):
        exp.persistent_step(*xs, strided, None, None, None, 0.25, None, True, None, exp.Variant())
