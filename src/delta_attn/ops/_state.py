"""Decode helpers shared by the recurrent operators' reference paths."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch


def start_slots(indices: torch.Tensor, num_accepted: Optional[torch.Tensor]) -> torch.Tensor:
    """The slot each sequence starts from: ``indices[b]`` for (B,) slots; for (B, T) slots (speculative)
    ``indices[b, num_accepted[b] - 1]``, column 0 when ``num_accepted`` is None. Device ops only (no sync)."""
    if indices.dim() == 1:
        return indices.long()
    if num_accepted is None:
        return indices[:, 0].long()
    return indices.long().gather(1, (num_accepted.long() - 1).unsqueeze(1)).squeeze(1)


@torch.no_grad()
def step_on_pool(pool: torch.Tensor, indices: Optional[torch.Tensor], num_accepted: Optional[torch.Tensor],
                 tokens: int, run: Callable[[torch.Tensor, slice], Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Gather each sequence's start state from ``pool``, ``run(states, token slice) -> (o, new_states)``,
    write back: after the last token to the start slot ((B,) or no indices), or after every token t to
    ``indices[:, t]`` ((B, T) indices, speculative decoding; all starts are gathered before any write)."""
    states = pool if indices is None else pool.index_select(0, start_slots(indices, num_accepted))
    if indices is None or indices.dim() == 1:
        o, new_states = run(states, slice(0, tokens))
        if indices is None:
            pool.copy_(new_states.to(pool.dtype))
        else:
            pool.index_copy_(0, indices.long(), new_states.to(pool.dtype))
        return o
    outs = []
    for t in range(tokens):
        o, states = run(states, slice(t, t + 1))
        pool.index_copy_(0, indices[:, t].long(), states.to(pool.dtype))
        outs.append(o)
    return torch.cat(outs, 1)
