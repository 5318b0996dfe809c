"""The validated call of the gated diagonal operators (``diag``, ``diag_step``), as every backend receives it.
Imports no backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...backends import Call, recurrent_features


@dataclass(frozen=True)
class DiagArgs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    initial_state: Optional[torch.Tensor]
    output_final_state: bool
    cu_seqlens: Optional[torch.Tensor]
    num_seqs: int
    state: Optional[torch.Tensor] = None            # gated_diag_step: the state pool, updated in place
    state_indices: Optional[torch.Tensor] = None    # slot of each sequence (B,) or token (B, T)
    num_accepted_tokens: Optional[torch.Tensor] = None   # with (B, T) slots: start slot column + 1

    def call(self, op: str) -> Call:
        feats = recurrent_features(self.cu_seqlens, self.initial_state, self.output_final_state, self.state_indices)
        return Call(op=op, device=self.q.device, dtype=self.q.dtype, head_dims=(self.q.shape[-1],),
                    features=frozenset(feats), needs_grad=self.needs_grad())

    def needs_grad(self) -> bool:
        """Grad mode on and a differentiable input (q, k, v, g, initial_state) requires grad."""
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (self.q, self.k, self.v, self.g, self.initial_state))
