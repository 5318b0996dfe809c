"""Numerics helpers for tests and for the benchmark's correctness gate.

The error rule (docs/TESTING.md, flash-attn's rule): a kernel's result passes when its largest absolute
error against the float64 reference is at most ``factor`` times the error of the same computation
done in PyTorch in the kernel's precision, plus a small floor; ``factor`` is 2 for forward outputs
and 3 for gradients. NaN or inf where the reference is finite never passes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from . import _outputs

FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 3.0


@dataclass
class Verdict:
    ok: bool
    error: float        # max |out - ref64|
    baseline: float     # max |ref_lowp - ref64|
    bound: float        # factor * baseline + floor
    message: str

    def __bool__(self) -> bool:
        return self.ok


def default_floor(ref64: torch.Tensor) -> float:
    scale = float(ref64.abs().max()) if ref64.numel() else 0.0
    return 1e-5 * max(1.0, scale)


def attention_grad_floor(grads64, dtype: torch.dtype) -> float:
    """The floor for attention gradients (dq, dk, dv together): one unit of rounding of the input dtype at the
    scale of the largest of them, ``max(eps(dtype) * G, 1e-5 * max(1, G))`` with G = max |grad|.

    Why one floor for the three, and why eps: where every row sees one key, p = 1 and the exact dq and dk are 0,
    and so is the error of the low-precision reference (its softmax backward gives exactly 0). A flash backward
    takes dS = P (dP - rowsum(dO * O)) from two differently rounded fp32 sums, times |softmax_scale|: with scales
    of 25-40, PyTorch's FA2 and cuDNN backends leave up to 9x the former 1e-5 floor there (docs/TESTING.md),
    all below one unit of the input dtype's rounding of the largest gradient. flash-attn's own tests allow
    ``2 * eps(dtype) * |ref|``; this floor is half of that, taken at the largest gradient."""
    g = max([0.0] + [float(t.abs().max()) for t in grads64 if t is not None and t.numel()])
    eps = torch.finfo(dtype).eps if dtype in (torch.float16, torch.bfloat16) else 0.0
    return max(eps * g, 1e-5 * max(1.0, g))


def check(out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, *, kind: str = "fwd",
          floor: Optional[float] = None, name: str = "output") -> Verdict:
    """Apply the error rule. ``kind`` is ``"fwd"`` (factor 2) or ``"grad"`` (factor 3)."""
    if kind not in ("fwd", "grad"):
        raise ValueError(f"kind must be 'fwd' or 'grad', got {kind!r}")
    if tuple(out.shape) != tuple(ref64.shape):
        return Verdict(False, float("inf"), 0.0, 0.0,
                       f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}")
    factor = FORWARD_FACTOR if kind == "fwd" else GRADIENT_FACTOR
    out64, ref64, low64 = (t.detach().to(torch.float64).cpu() for t in (out, ref64, ref_lowp))
    finite_ref = torch.isfinite(ref64)
    # where the reference itself is +-inf (an lse of an empty row), the result must match it exactly
    if not torch.equal(out64[~finite_ref], ref64[~finite_ref]):
        return Verdict(False, float("inf"), 0.0, 0.0, f"{name}: non-finite entries differ from the reference")
    if not torch.isfinite(out64[finite_ref]).all():
        bad = int((~torch.isfinite(out64[finite_ref])).sum())
        return Verdict(False, float("nan"), 0.0, 0.0, f"{name}: {bad} NaN/inf entries where the reference is finite")
    if ref64[finite_ref].numel() == 0:
        return Verdict(True, 0.0, 0.0, 0.0, f"{name}: empty")
    err = float((out64 - ref64)[finite_ref].abs().max())
    base = float((low64 - ref64)[finite_ref].abs().max())
    if base != base:
        base = float("inf")
    fl = default_floor(ref64[finite_ref]) if floor is None else floor
    bound = factor * base + fl
    ok = err <= bound
    relation = "<=" if ok else ">"
    return Verdict(ok, err, base, bound,
                   f"{name}: max error {err:.3e} {relation} {factor:g} x {base:.3e} + {fl:.1e} = {bound:.3e}")


def assert_close(out, ref64, ref_lowp, *, kind: str = "fwd", floor: Optional[float] = None,
                 name: str = "output") -> Verdict:
    v = check(out, ref64, ref_lowp, kind=kind, floor=floor, name=name)
    assert v.ok, v.message
    return v


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Inside this block kernels' floating outputs start as NaN, so unwritten elements fail."""
    _outputs._poison_depth += 1
    try:
        yield
    finally:
        _outputs._poison_depth -= 1
