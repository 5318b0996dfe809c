"""Triton helpers shared by the kernels of several operators (the bottom layer of ``ops/``: it imports no
operator package).

``_ld`` / ``_st``: a load / store that drops its mask when the launcher knows every element is in bounds
(``EVEN``: the shapes divide the tiles), used by the gated diagonal scans and the decode steps of KDA and of
the diagonal recurrence.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ld(ptr, m, EVEN: tl.constexpr):
    if EVEN:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=m, other=0.0)
    return x


@triton.jit
def _st(ptr, x, m, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, x)
    else:
        tl.store(ptr, x, mask=m)
