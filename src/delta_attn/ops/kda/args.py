"""The validated call of Kimi Delta Attention (``kda``, ``kda_step``), as every backend receives it. Imports no
backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...backends import Call, recurrent_features


@dataclass(frozen=True)
class KDAArgs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float
    initial_state: Optional[torch.Tensor]
    output_final_state: bool
    cu_seqlens: Optional[torch.Tensor]
    num_seqs: int
    use_qk_l2norm: bool
    A_log: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]
    lower_bound: Optional[float]
    state: Optional[torch.Tensor] = None            # kda_step: the state pool, updated in place
    state_indices: Optional[torch.Tensor] = None    # kda_step: slot of each sequence (B,) or token (B, T)
    num_accepted_tokens: Optional[torch.Tensor] = None   # kda_step with (B, T) slots: start slot column + 1
    allow_tf32: bool = False                        # fp32 inputs: tf32 tensor-core dots allowed

    def call(self, op: str, strong_decay: bool = False, decay_unread: bool = False) -> Call:
        """The registry's :class:`~delta_attn.backends.Call` (``seqlen``: T of a dense batch, rounded up to a power of
        two; 0 when packed). ``strong_decay``: g goes below what cuDNN's kernel takes (read from the values by
        ``api.py``, one host sync, only where cuDNN would run the call); ``decay_unread``: ``auto`` would try cuDNN
        but value checks are off (torch.compile, CUDA-graph capture, a plan), so g's range cannot be read."""
        feats = recurrent_features(self.cu_seqlens, self.initial_state, self.output_final_state, self.state_indices)
        if strong_decay:
            feats.add("strong_decay")
        if decay_unread:
            feats.add("decay_unread")
        if self.use_qk_l2norm:
            feats.add("qk_l2norm")
        if self.A_log is not None:
            feats.add("gate_lower_bound" if self.lower_bound is not None else "gate_softplus")
        if self.v.shape[2] != self.q.shape[2]:
            feats.add("gva")
        t = self.q.shape[1]
        return Call(op=op, device=self.q.device, dtype=self.q.dtype,
                    head_dims=(self.q.shape[-1], self.v.shape[-1]), features=frozenset(feats),
                    needs_grad=self.needs_grad(),
                    seqlen=1 << (t - 1).bit_length() if self.cu_seqlens is None and t > 0 else 0)

    def needs_grad(self) -> bool:
        """Grad mode on and some differentiable input requires grad (under ``torch.no_grad`` inputs that
        require grad still get the forward without gradient)."""
        tensors = (self.q, self.k, self.v, self.g, self.beta, self.initial_state, self.A_log, self.dt_bias)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
