"""The correctness gate: an implementation is timed only after its output (and, for rows with a
backward pass, its gradients) passed the error rule (docs/TESTING.md) against the float64 reference on a
probe of the same configuration (same dtype, head dims, options; a smaller batch and length).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from delta_attn.testing import check

from . import cases
from .impls import Impl


class Unavailable(Exception):
    """The implementation turned out not to run this call (e.g. SDPA found no kernel)."""


_UNAVAILABLE_MARKERS = ("No available kernel", "not supported", "Unsupported", "unsupported")


def is_unavailable_error(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, (NotImplementedError,)) or any(m in text for m in _UNAVAILABLE_MARKERS)


@dataclass
class GateResult:
    ok: bool
    message: str
    max_error: float = float("nan")
    bound: float = float("nan")


def _cast(ts: List[torch.Tensor], dtype=None) -> List[torch.Tensor]:
    out = []
    for t in ts:
        x = t.detach()
        x = x.to(torch.float64) if (dtype is not None and x.is_floating_point()) else x.clone()
        out.append(x.requires_grad_(x.is_floating_point()))
    return out


def run_gate(impl: Impl, case: Dict, device: torch.device, dtype: torch.dtype, grad: bool, seed: int,
             tiny: bool = False) -> GateResult:
    probe = cases.probe_case(case, cap=16 if tiny else None)
    t = cases.make_inputs(probe, device, dtype, seed=seed + 1)
    b = impl.bind(probe, t)
    with b.context():
        with torch.set_grad_enabled(grad):
            out = b.post(b.fn())
    l64, llp = _cast(b.leaves, torch.float64), _cast(b.leaves)
    with torch.enable_grad():
        ref64 = b.spec(l64, True)
        reflp = b.spec(llp, False)
    verdicts = [check(out, ref64, reflp, kind="fwd", name="output")]
    if grad:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + 2)
        dout = torch.randn(out.shape, generator=gen, device=device, dtype=torch.float32).to(out.dtype)
        with b.context():
            gi = torch.autograd.grad(out, b.leaves, dout, allow_unused=True)
        g64 = torch.autograd.grad(ref64, l64, dout.to(torch.float64), allow_unused=True)
        glp = torch.autograd.grad(reflp, llp, dout.to(reflp.dtype), allow_unused=True)
        for i, (a, r, lp) in enumerate(zip(gi, g64, glp)):
            if r is None:
                continue
            if a is None:
                verdicts.append(None)
                return GateResult(False, f"gradient of input {i} is missing")
            verdicts.append(check(a, r, lp, kind="grad", name=f"grad[{i}]"))
    bad = [v for v in verdicts if not v.ok]
    worst = max(verdicts, key=lambda v: (v.error / v.bound) if v.bound > 0 else float("inf"))
    if bad:
        return GateResult(False, "; ".join(v.message for v in bad), bad[0].error, bad[0].bound)
    return GateResult(True, worst.message, worst.error, worst.bound)


def gate_key(impl: Impl, case: Dict, dtype: torch.dtype, grad: bool, tiny: bool = False) -> Tuple:
    probe = cases.probe_case(case, cap=16 if tiny else None)
    probe.pop("B", None)
    return (impl.name, impl.op, str(dtype), grad, tuple(sorted((k, str(v)) for k, v in probe.items())))
