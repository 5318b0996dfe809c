"""Decode helpers shared by the recurrent operators' reference paths."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch


@torch.no_grad()
def step_on_pool(pool: torch.Tensor, indices: Optional[torch.Tensor],
                 run: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Gather each sequence's state from ``pool``, ``run(states) -> (o, new_states)``, write back."""
    states = pool if indices is None else pool.index_select(0, indices.long())
    o, new_states = run(states)
    if indices is None:
        pool.copy_(new_states.to(pool.dtype))
    else:
        pool.index_copy_(0, indices.long(), new_states.to(pool.dtype))
    return o
