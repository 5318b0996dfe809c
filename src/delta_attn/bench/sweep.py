"""The one way to sweep kernel configurations: :func:`sweep`.

Each candidate runs through the suites' runner, so it gets what every suite row gets: the correctness
gate (the error rule of docs/TESTING.md against the float64 reference on a probe of the same configuration) before
any timing, then :func:`delta_attn.bench.timer.measure` and the FLOP / byte models of
:mod:`delta_attn.bench.models`. A candidate that fails the gate is a ``FAILED`` row with no time.

A candidate is a callable that takes the case's inputs by name (those of ``cases.make_inputs``: ``q``,
``k``, ``v`` and, per operator, ``g``, ``beta``, ``cu_seqlens``, ``state``) and returns the output the gate
checks. The configuration is an argument of the launcher, never an environment variable or a module
global. Example: the gated diagonal forward's tiles (``diag_fwd(config=...)``) on the bar shape::

    from delta_attn.bench.runner import Settings
    from delta_attn.bench.sweep import sweep
    from delta_attn.ops.diag import launch as ti

    configs = [ti.FWD_CONFIG, ti.FwdConfig(bt=64, bd=64, w=8, warps=4, split=4),
               ti.FwdConfig(bt=32, bd=64, w=4, warps=2, split=2)]
    rows = sweep(dict(op="diag", B=1, S=32768, H=16, D=128),
                 {str(c): (lambda c: lambda q, k, v, g: ti.diag_fwd(q, k, v, g, config=c)[0])(c)
                  for c in configs}, Settings())
    for r in sorted(rows, key=lambda r: r.ms or float("inf")):
        print(r.impl, r.status, r.ms, r.frac_copy, r.note)

Backward directions (``"bwd"``, ``"fwd+bwd"``) need a differentiable candidate. The rows are
``BenchRow`` objects (bench/rows.py; ``to_json()``: the ``results.jsonl`` row schema of docs/BENCH.md)
with ``suite = "sweep"``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import cases
from .impls import Bound, Impl, _leaf
from .rows import BenchRow
from .runner import DTYPES, Runner, Settings, Task, measure_ceilings


def sweep(case: Dict, candidates: Dict[str, Callable[..., torch.Tensor]], settings: Settings,
          directions: Sequence[str] = ("fwd",), dtype: str = "bf16",
          ceilings: Optional[Dict] = None) -> List[BenchRow]:
    """Gate, then time, every candidate on ``case`` (a suite case: ``op`` plus its sizes); one row per
    (candidate, direction), in the candidates' order. ``ceilings`` (copy bandwidth, GEMM rate) are
    measured first unless given; they fill ``frac_copy`` / ``frac_gemm``."""
    op = case["op"]
    grad_names = cases.GRAD_INPUTS.get(op, ())
    family = "linear" if op in cases.LINEAR_OPS else "quadratic"

    def candidate(name: str, call: Callable[..., torch.Tensor]) -> Impl:
        def bind(c, t):
            t = {k: (_leaf(v) if k in grad_names else v) for k, v in t.items()}
            return Bound(fn=lambda: call(**t), leaves=[t[k] for k in cases.SPEC_INPUTS[op]],
                         spec=cases.spec(op, c, t), inputs=list(t.values()))
        return Impl(name, op, family, "delta-attn", bind, lambda c, dev, dt, grad: None,
                    backward=bool(grad_names))

    device = torch.device(settings.device)
    if ceilings is None:
        ceilings = measure_ceilings(device, settings)
    tasks = [Task("sweep", dict(case), candidate(name, call), tuple(directions), DTYPES[dtype],
                  series=f"sweep:{name}") for name, call in candidates.items()]
    return Runner(settings, ceilings).run(tasks, desc=f"sweep {op} {cases.label(case)}")
