"""FLOP and byte models (the conventions of docs/PEERS.md).

Attention: forward = 2 · (D + Dv) · B · H · (unmasked query-key pairs), i.e. 4·B·H·Sq·Sk·D for a full
square and about half of it for causal; backward = 2.5 × forward; forward+backward = 3.5 × forward.
Memory-bound operators (the diagonal recurrence, decode, copies) are measured in bytes: each input
read once and each output written once (for a backward pass: inputs and output gradients read,
input gradients written).
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple

import torch

BWD_FACTOR = 2.5
DIRECTION_FACTOR = {"fwd": 1.0, "bwd": BWD_FACTOR, "fwd+bwd": 1.0 + BWD_FACTOR}


def visible_pairs(sq: int, sk: int, causal: bool, window: Tuple[int, int] = (-1, -1)) -> int:
    """Number of (query, key) pairs the mask leaves visible (bottom-right aligned, as the spec)."""
    wl, wr = window
    if causal:
        wr = 0
    total = 0
    off = sk - sq
    if wl < 0 and wr < 0:
        return sq * sk
    # closed form per row would do; a loop over rows is exact and cheap enough for the sizes here
    if wl < 0 and wr == 0 and off >= 0:
        # causal, square or Sk > Sq: row i sees keys 0 .. i + off
        return sq * (off + 1) + sq * (sq - 1) // 2
    for i in range(sq):
        lo = 0 if wl < 0 else max(0, i + off - wl)
        hi = sk - 1 if wr < 0 else min(sk - 1, i + off + wr)
        total += max(0, hi - lo + 1)
    return total


def attention_flops(b: int, h: int, sq: int, sk: int, d: int, dv: Optional[int] = None, causal: bool = False,
                    direction: str = "fwd", pairs: Optional[int] = None) -> float:
    dv = d if dv is None else dv
    pairs = visible_pairs(sq, sk, causal) if pairs is None else pairs
    return 2.0 * (d + dv) * b * h * pairs * DIRECTION_FACTOR[direction]


def varlen_attention_flops(seqlens: Iterable[int], h: int, d: int, causal: bool, direction: str = "fwd") -> float:
    pairs = sum(visible_pairs(s, s, causal) for s in seqlens)
    return 2.0 * 2 * d * h * pairs * DIRECTION_FACTOR[direction]


def nbytes(tensors: Sequence[Optional[torch.Tensor]]) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))


def io_bytes(inputs: Sequence[torch.Tensor], output: torch.Tensor, grads: Sequence[torch.Tensor],
             direction: str, accumulate: bool = False) -> int:
    """Bytes moved by one call: fwd reads the inputs and writes the output; bwd reads the inputs and
    the output gradient and writes one gradient per input that needs one (accumulate: and adds it
    into the existing gradient: one more read of each and a read and write of the sum)."""
    fwd = nbytes(inputs) + nbytes([output])
    bwd = nbytes(inputs) + nbytes([output]) + nbytes(grads) * (4 if accumulate else 1)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[direction]


def gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k
