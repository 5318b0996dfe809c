"""Output allocation for every kernel launcher.

Kernels allocate their outputs through :func:`empty`. Under ``delta_attn.testing.poison_outputs()``
(or ``DELTA_ATTN_POISON_OUTPUTS=1``) floating outputs are filled with NaN first, so an element a
kernel forgot to write fails every comparison instead of passing by luck.
"""
from __future__ import annotations

import torch

from . import settings

_poison_depth = 0


def poisoning() -> bool:
    return _poison_depth > 0 or settings.poison_outputs()


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if poisoning() and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def empty_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return empty(t.shape, dtype or t.dtype, t.device)
