"""Triton helpers shared by the decode kernels (``kda_step``, ``gated_diag_step``): which state-pool slot a
sequence starts from and which slot each token's state goes to.

``IDX`` names the slot layout: 0, no ``state_indices`` (sequence b uses slot b); 1, (B,) indices (one slot,
read and written); 2, (B, T) indices (speculative decoding: the state after token t is written to
``idx[b, t]``; the start is ``idx[b, nat[b] - 1]`` with ``HAS_NAT``, else ``idx[b, 0]``). Index tensors are
unit-stride (the launchers make them so).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _start_slot(idx, nat, b, T, IDX: tl.constexpr, HAS_NAT: tl.constexpr):
    """The slot sequence ``b`` (int64) starts from."""
    if IDX == 0:
        slot = b
    elif IDX == 1:
        slot = tl.load(idx + b).to(tl.int64)
    else:
        col = 0
        if HAS_NAT:
            col = tl.load(nat + b).to(tl.int64) - 1
        slot = tl.load(idx + b * T + col).to(tl.int64)
    return slot


@triton.jit
def _token_slot(idx, b, T, t):
    """(B, T) indices: the slot that receives the state after token ``t`` of sequence ``b``."""
    return tl.load(idx + b * T + t).to(tl.int64)
