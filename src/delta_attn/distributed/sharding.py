"""Sequence sharding for context parallelism: which tokens each rank holds, ``shard`` and ``unshard``.

Layouts of the sequence dimension over the W ranks of a group:

- ``"contiguous"``: rank r holds tokens [r * T/W, (r + 1) * T/W) (T divisible by W).
- ``"zigzag"``: the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W - 1 - r, in
  that order (T divisible by 2W). Under a causal mask every rank then gets the same amount of work.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .. import _checks as C
from ._comm import all_gather, group_rank_world

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> str:
    C.one_of("layout", layout, LAYOUTS)
    return layout


def _check_dim(x: torch.Tensor, dim: int, name: str) -> int:
    """``x`` is a tensor and ``dim`` one of its dimensions; returns ``dim`` made non-negative."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must index a dimension of {name} (shape {tuple(x.shape)}), got {dim}")
    return dim % x.dim()


def chunks_per_rank(layout: str) -> int:
    """Equal chunks of the sequence per rank: 1 (contiguous) or 2 (zigzag)."""
    return 2 if check_layout(layout) == "zigzag" else 1


def local_length(total: int, world: int, layout: str = "contiguous", name: str = "the sequence length") -> int:
    """Tokens per rank for a sequence of ``total`` tokens; ValueError when it does not divide evenly."""
    parts = world * chunks_per_rank(layout)
    if total % parts != 0:
        what = f"2 x world size = {parts}" if layout == "zigzag" else f"the world size {world}"
        raise ValueError(f"{name} must be divisible by {what} for layout={layout!r}, got {total}")
    return total // world


def zigzag_chunks(rank: int, world: int) -> Tuple[int, int]:
    """The two chunk indices (of 2W) that rank ``rank`` holds under the zigzag layout, in local order."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    return rank, 2 * world - 1 - rank


def chunk_ranges(t_local: int, rank: int, world: int, layout: str = "contiguous") -> Tuple[Tuple[int, int], ...]:
    """Global [start, end) token ranges held by ``rank``, in local order (one range, or two for zigzag)."""
    if check_layout(layout) == "contiguous":
        return ((rank * t_local, (rank + 1) * t_local),)
    if t_local % 2 != 0:
        raise ValueError(f"the local length must be even for layout='zigzag', got {t_local}")
    c = t_local // 2
    return tuple((i * c, (i + 1) * c) for i in zigzag_chunks(rank, world))


def positions(t_local: int, rank: int, world: int, layout: str = "contiguous", device=None) -> torch.Tensor:
    """Global token index (int64, shape (t_local,)) of each local token of ``rank``."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in chunk_ranges(t_local, rank, world, layout)])


def shard(x: torch.Tensor, *, group=None, dim: int = 1, layout: str = "contiguous") -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (the sequence, dim 1 of (B, T, H, D)).

    Every rank passes the same full tensor. Contiguous layout: a view; zigzag: a copy of the rank's two
    chunks. Differentiable (the gradient of ``x`` is zero outside this rank's tokens).
    """
    dim = _check_dim(x, dim, "x")
    rank, world = group_rank_world(group)
    t_local = local_length(x.shape[dim], world, layout, f"x.shape[{dim}]")
    pieces = [x.narrow(dim, a, b - a) for a, b in chunk_ranges(t_local, rank, world, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def unshard(x_local: torch.Tensor, *, group=None, dim: int = 1, layout: str = "contiguous") -> torch.Tensor:
    """The full tensor from every rank's shard (an all-gather along ``dim``), on every rank.

    Differentiable: the gradient reaching a shard is the sum of what every rank's use of the full tensor
    sends back (torch.distributed.nn convention), so a loss computed identically on every rank counts W
    times; compute it on one rank, or on each rank's own shard.
    """
    dim = _check_dim(x_local, dim, "x_local")
    rank, world = group_rank_world(group)
    check_layout(layout)
    t_local = x_local.shape[dim]
    if layout == "zigzag" and t_local % 2 != 0:
        raise ValueError(f"x_local.shape[{dim}] must be even for layout='zigzag', got {t_local}")
    stacked = all_gather(x_local, group)                         # (W, ..., t_local, ...)
    parts = stacked.unbind(0)
    if layout == "contiguous":
        return torch.cat(parts, dim)
    c = t_local // 2
    ordered = [None] * (2 * world)
    for r, part in enumerate(parts):
        for j, idx in enumerate(zigzag_chunks(r, world)):
            ordered[idx] = part.narrow(dim, j * c, c)
    return torch.cat(ordered, dim)
