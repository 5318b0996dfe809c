"""The validated calls of the attention operators, as every backend receives them. Imports no backend.

:class:`AttnArgs` (``flash`` / ``flash_varlen``; backends return ``(out, lse)``: out in the layout of q, lse
float32 (B, Hq, Sq) dense or (Hq, total_q) varlen) and :class:`KVCacheArgs` (``flash_kvcache``; backends return
``(out (B, Sq, Hq, D), lse (B, Hq, Sq) float32)`` after writing the new keys / values into the caches in
place). ``call()`` gives the registry's :class:`~delta_attn.backends.Call`: what the call needs from a backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ...backends import Call

LAYOUTS = ("thd", "htd")     # varlen layouts: "thd" (total, H, D) as flash-attn; "htd" (H, total, D)


@dataclass(frozen=True)
class Varlen:
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    layout: str               # "thd": (total, H, D); "htd": (H, total, D)
    num_seqs: int


@dataclass(frozen=True)
class AttnArgs:
    """A validated attention call. ``window`` already folds ``causal`` in (right bound 0)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    softmax_scale: float
    causal: bool
    window: Tuple[int, int]
    softcap: float
    alibi_slopes: Optional[torch.Tensor]
    dropout_p: float
    deterministic: bool
    return_lse: bool
    varlen: Optional[Varlen] = None

    @property
    def heads(self) -> Tuple[int, int]:
        """(Hq, Hk)"""
        if self.varlen is not None and self.varlen.layout == "htd":
            return self.q.shape[0], self.k.shape[0]
        return self.q.shape[-2], self.k.shape[-2]

    def call(self) -> Call:
        hq, hk = self.heads
        feats = set()
        if self.causal:
            feats.add("causal")
        if self.window != ((-1, 0) if self.causal else (-1, -1)):
            feats.add("window")
        if self.softcap > 0:
            feats.add("softcap")
        if self.alibi_slopes is not None:
            feats.add("alibi")
        if self.dropout_p > 0:
            feats.add("dropout")
        if hq != hk:
            feats.add("gqa")
        if self.deterministic:
            feats.add("deterministic")
        if self.k.shape[-1] != self.v.shape[-1]:
            feats.add("head_dim_v")
        if self.varlen is not None:
            feats.add("varlen")
            if self.varlen.layout == "htd":
                feats.add("layout_htd")
        else:
            if self.q.shape[1] != self.k.shape[1]:
                feats.add("sq_ne_sk")
            if self.q.shape[1] == self.k.shape[1] == 1:
                feats.add("single_token")       # Sq = Sk = 1 (PyTorch's cuDNN SDPA refuses it)
        return Call(op="flash_varlen" if self.varlen is not None else "flash", device=self.q.device,
                    dtype=self.q.dtype, head_dims=(self.q.shape[-1], self.v.shape[-1]),
                    features=frozenset(feats), needs_grad=self.needs_grad())

    def needs_grad(self) -> bool:
        """Grad mode on and q, k or v requires grad (the backward follows)."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.v))


@dataclass(frozen=True)
class KVCacheArgs:
    """A validated call. ``window`` folds ``causal`` in (right bound 0) and, as flash-attn, counts a bound
    at least the cache capacity as unbounded; ``cache_seqlens`` is always a (B,) int32 tensor."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    rotary_cos: Optional[torch.Tensor]
    rotary_sin: Optional[torch.Tensor]
    cache_seqlens: torch.Tensor
    cache_batch_idx: Optional[torch.Tensor]
    cache_leftpad: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    softmax_scale: float
    causal: bool
    window: Tuple[int, int]
    softcap: float
    rotary_interleaved: bool
    alibi_slopes: Optional[torch.Tensor]
    num_splits: int
    return_lse: bool

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def capacity(self) -> int:
        """Cache positions one sequence can hold."""
        if self.paged:
            return self.block_table.shape[1] * self.k_cache.shape[1]
        return self.k_cache.shape[1]

    @property
    def rotary_per_query(self) -> bool:
        """Query i is rotated at position cache_seqlens + i (causal or windowed); else all at cache_seqlens."""
        return self.window != (-1, -1)

    def call(self) -> Call:
        feats = {name for name, used in (
            ("causal", self.causal), ("window", self.window != ((-1, 0) if self.causal else (-1, -1))),
            ("softcap", self.softcap > 0), ("alibi", self.alibi_slopes is not None),
            ("gqa", self.q.shape[2] != self.k_cache.shape[2]), ("paged", self.paged),
            ("new_kv", self.k is not None), ("rotary", self.rotary_cos is not None),
            ("cache_batch_idx", self.cache_batch_idx is not None), ("leftpad", self.cache_leftpad is not None),
        ) if used}
        tensors = (self.q, self.k_cache, self.v_cache, self.k, self.v)
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
        return Call(op="flash_kvcache", device=self.q.device, dtype=self.q.dtype,
                    head_dims=(self.q.shape[-1], self.v_cache.shape[-1]), features=frozenset(feats),
                    needs_grad=needs_grad)
