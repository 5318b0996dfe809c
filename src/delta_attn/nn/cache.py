"""Decode caches of the layers: small dataclasses a layer fills on its first call and updates in place.

Pass an empty cache (``KVCache()``, ``RecurrentCache()``) to the prefill call; pass the same object
to every following call. A cache covers one batch: its row b is sequence b (for a varlen prefill,
sequence n of ``cu_seqlens``; the following calls then use a (N, T, C) batch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

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
class PagedKVCache:
    """Keys and values of an attention layer in a preallocated pool of pages (the layout of
    :func:`delta_attn.flash_attn_with_kvcache`'s ``block_table``), with static device addresses so a
    decode step can be captured in a CUDA graph.

    ``max_seqlen``: the tokens one sequence may reach (prompt + new tokens); ``page_size``: tokens per
    page; ``num_blocks``: pages in the pool (None: enough for every sequence to reach ``max_seqlen``).
    The layer allocates on its first call: ``k_pages`` / ``v_pages`` (num_blocks, page_size, Hk, D)
    (rotary embeddings applied), ``block_table`` (B, ceil(max_seqlen / page_size)) int32 and
    ``cache_seqlens`` (B,) int32 (each sequence's real tokens so far: the rotary position of its next
    token), then advances ``cache_seqlens`` in place.

    Pages are handed out on the host (:meth:`reserve`) before a call writes into them, from a free list;
    an eager call reserves what it needs. Inside a captured graph nothing is reserved: reserve the
    tokens of every replay before capturing (``cache.reserve(n)`` covers the next ``n`` tokens per
    sequence). ``host_len`` is a host-side upper bound of each row's length (it counts padding and does
    not follow graph replays).
    """
    max_seqlen: int
    page_size: int = 256
    num_blocks: Optional[int] = None
    k_pages: Optional[torch.Tensor] = None
    v_pages: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    cache_seqlens: Optional[torch.Tensor] = None
    host_len: List[int] = field(default_factory=list)
    _pages: List[List[int]] = field(default_factory=list, repr=False)   # pages of each row, in order
    _free: List[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        for name in ("max_seqlen", "page_size"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if self.num_blocks is not None and (isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int)
                                            or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be None or an int >= 1, got {self.num_blocks!r}")

    @property
    def empty(self) -> bool:
        return self.k_pages is None

    @property
    def max_blocks(self) -> int:
        return -(-self.max_seqlen // self.page_size)

    def allocate(self, batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Allocate the pool, an empty block table and zero lengths for ``batch`` sequences."""
        nb = self.num_blocks if self.num_blocks is not None else batch * self.max_blocks
        shape = (nb, self.page_size, num_kv_heads, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.block_table = torch.zeros(batch, self.max_blocks, dtype=torch.int32, device=device)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.host_len, self._pages, self._free = [0] * batch, [[] for _ in range(batch)], list(range(nb))

    def reserve(self, num_tokens: int) -> None:
        """Hand out pages (host side, one small copy of the block table) so that every row can take
        ``num_tokens`` more tokens than ``host_len``."""
        need = [-(-(n + num_tokens) // self.page_size) for n in self.host_len]
        if max(need, default=0) > self.max_blocks:
            raise ValueError(f"the paged cache holds max_seqlen = {self.max_seqlen} tokens per sequence, got "
                             f"{max(self.host_len) + num_tokens} (cached {max(self.host_len)} + new {num_tokens})")
        missing = sum(max(0, m - len(p)) for m, p in zip(need, self._pages))
        if missing > len(self._free):
            raise ValueError(f"the paged cache is out of pages: {missing} more needed, {len(self._free)} free "
                             f"(num_blocks = {self.k_pages.shape[0]})")
        if not missing:
            return
        for m, pages in zip(need, self._pages):
            while len(pages) < m:
                pages.append(self._free.pop(0))
        table = torch.zeros(self.block_table.shape, dtype=torch.int32)
        for b, pages in enumerate(self._pages):
            table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.block_table.copy_(table)

    def advance(self, num_tokens: int) -> None:
        """Move the host bound on (after an eager call wrote up to ``num_tokens`` tokens per row)."""
        self.host_len = [n + num_tokens for n in self.host_len]

    def write(self, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        """Append k / v (B, T, Hk, D) (the real tokens of ``mask`` (B, T), or all) after each row's
        cached tokens and advance ``cache_seqlens``; the pages must be reserved."""
        b, t = k.shape[:2]
        real = torch.ones(b, t, dtype=torch.bool, device=k.device) if mask is None else mask.bool()
        pos = self.cache_seqlens.long().unsqueeze(1) + real.long().cumsum(1) - 1            # (B, T)
        pos = pos.clamp(min=0)
        page = self.block_table.long().gather(1, (pos // self.page_size).clamp(max=self.max_blocks - 1))
        flat = (page * self.page_size + pos % self.page_size)[real]
        self.k_pages.view(-1, *k.shape[2:]).index_copy_(0, flat, k[real].to(self.k_pages.dtype))
        self.v_pages.view(-1, *v.shape[2:]).index_copy_(0, flat, v[real].to(self.v_pages.dtype))
        self.cache_seqlens.add_(real.sum(1, dtype=torch.int32))

    def reorder(self, index: torch.Tensor) -> None:
        """Keep / reorder batch rows (dropping finished sequences frees their pages). A row cannot be
        repeated (two rows would write the same pages)."""
        if self.empty:
            return
        idx = [int(i) for i in index.tolist()]
        if len(set(idx)) != len(idx) or any(not 0 <= i < len(self.host_len) for i in idx):
            raise ValueError(f"index must hold distinct rows in [0, {len(self.host_len)}), got {idx}")
        keep = set(idx)
        for b, pages in enumerate(self._pages):
            if b not in keep:
                self._free.extend(pages)
        self._pages = [self._pages[i] for i in idx]
        self.host_len = [self.host_len[i] for i in idx]
        index = index.to(self.block_table.device)
        self.block_table = self.block_table.index_select(0, index)
        self.cache_seqlens = self.cache_seqlens.index_select(0, index)


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
