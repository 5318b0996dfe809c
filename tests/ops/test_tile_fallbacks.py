"""The launch layer's fallback tiles on CPU, for the KDA pipelines, whose launchers list halved tiles after the tuned
ones: on a GPU a kernel runs the first tile candidate whose compiled kernel fits the shared memory, so a large head
dim or an fp32 work dtype runs a later candidate (halved tiles, one pipeline stage, the state scans' two row
halves); the interpreter has no limit and takes the first. Here every launch takes its LAST candidate (the smallest
tiles) or its first SPLIT = 2 one (the rest: the first; these runs take gradients), on seeded configurations of
70-145 tokens (several 64-token chunks, a partial last one, some packed with an empty sequence), which must pass the
error rule against the float64 reference (tests/properties.py)."""
from __future__ import annotations

import dataclasses

import pytest

import properties as P
from delta_attn.ops import _launch

SEEDS = range(6)


def _case(seed: int, grad: bool) -> P.KDACase:
    """The CPU draw of ``seed`` at 70 + 15 seed tokens; packed as (0, 33, 33, T) for every third seed; gradients for
    every other seed or where ``grad`` (the training pipeline's 64-token chunks)."""
    c = P.draw("kda", seed, "cpu").p["kda"]
    T = 70 + 15 * seed
    cu = (0, 33, 33, T) if seed % 3 == 0 else None
    return dataclasses.replace(c, B=1 if cu else c.B, T=T, cu=cu, grad=grad or c.grad or seed % 2 == 0)


def _take(policy: str):
    """A replacement for ``_launch._run`` that hands the real one a single candidate chosen by ``policy``."""
    real = _launch._run
    taken = []

    def run(p):
        c = p.candidates
        if policy == "last":
            t = c[-1]
        else:
            t = next((x for x in c if dict(x.meta).get("SPLIT") == 2), c[0])
        taken.append((t, c))
        return real(dataclasses.replace(p, candidates=(t,)))
    return run, taken


@pytest.mark.parametrize("policy", ["last", "split2"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kda_fallback_tiles_pass_the_error_rule(seed, policy, monkeypatch):
    run, taken = _take(policy)
    monkeypatch.setattr(_launch, "_run", run)
    case = _case(seed, grad=policy == "split2")      # the SPLIT candidates are the training scans'
    bad = P.kda_check(case, "cpu")
    assert not bad, f"{case}: " + "; ".join(bad)
    assert any(t != c[0] for t, c in taken), "no launch took a fallback candidate"
