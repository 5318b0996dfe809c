"""Decode caches of the layers: small dataclasses a layer fills on its first call and updates in place.

Pass an empty cache (``KVCache()``, ``RecurrentCache()``) to the prefill call; pass the same object
to every following call. A cache covers one batch: its row b is sequence b (for a varlen prefill,
sequence n of ``cu_seqlens``; the following calls then use a (N, T, C) batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class KVCache:
    """Keys and values of the attention layers.

    ``k``/``v`` (B, S, Hk, D) with rotary embeddings applied; ``mask`` (B, S) bool marks the real
    entries (None: all of them); ``seen`` (B,) int64 counts each sequence's real tokens so far (the
    rotary position of its next token).
    """
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    seen: Optional[torch.Tensor] = None

    @property
    def empty(self) -> bool:
        return self.k is None

    def reorder(self, index: torch.Tensor) -> None:
        """Keep / reorder batch rows (beam search, dropping finished sequences)."""
        for name in ("k", "v", "mask", "seen"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, index))


@dataclass
class RecurrentCache:
    """State of a linear-attention layer (KDA or gated diagonal).

    ``conv_state`` (B, W - 1, C): the last W - 1 inputs of the short convolutions (q, k and v channels
    side by side); ``state``: the recurrent state, (B, HV, K, V) for KDA, (B, H, D) for the diagonal
    layer, float32 (float64 for a float64 model).
    """
    conv_state: Optional[torch.Tensor] = None
    state: Optional[torch.Tensor] = None

    @property
    def empty(self) -> bool:
        return self.state is None

    def reorder(self, index: torch.Tensor) -> None:
        for name in ("conv_state", "state"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, index))


@dataclass
class CrossAttentionCache:
    """Projected keys and values of the memory of a cross-attention layer (computed once)."""
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    memory_mask: Optional[torch.Tensor] = None

    @property
    def empty(self) -> bool:
        return self.k is None
