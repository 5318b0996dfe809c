"""Softmax attention layers on :func:`delta_attn.flash_attn_func` / :func:`flash_attn_varlen_func`."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..ops.flash.api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from ._utils import Packing, RotaryEmbedding, make_packing, packing_from_mask
from .cache import CrossAttentionCache, KVCache, PagedKVCache


def _masked_attention(q, k, v, qmask: Optional[torch.Tensor], kmask: Optional[torch.Tensor], backend: str,
                      **kw) -> torch.Tensor:
    """q (B, Sq, Hq, D), k/v (B, Sk, Hk, D) with padding masks (None: all real) -> (B, Sq, Hq, Dv).

    Real queries and keys of each row are packed into a varlen call; the causal mask (when asked)
    is aligned bottom-right, i.e. a row's last real query sees its last real key.
    """
    if qmask is None and kmask is None:
        return flash_attn_func(q, k, v, backend=backend, **kw)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if qmask is None:
        qmask = torch.ones(b, sq, dtype=torch.bool, device=q.device)
    if kmask is None:
        kmask = torch.ones(b, sk, dtype=torch.bool, device=q.device)
    pq, pk = packing_from_mask(qmask), packing_from_mask(kmask)
    out = flash_attn_varlen_func(pq.pack(q), pk.pack(k), pk.pack(v), pq.cu_seqlens, pk.cu_seqlens, sq, sk,
                                 backend=backend, **kw)
    return pq.unpack(out)


class MultiheadAttention(nn.Module):
    """Multi-head / grouped-query self-attention with rotary embeddings and a KV cache.

    ``forward(x (B, T, C), attention_mask=None, cu_seqlens=None, max_seqlen=None, cache=None)``:
    ``attention_mask`` (B, T) marks real tokens (padding on any side; rotary positions count real
    tokens only); ``cu_seqlens`` int32 (N + 1,) with B == 1 runs N packed sequences (varlen);
    ``cache`` (:class:`KVCache` or :class:`PagedKVCache`, filled in place) makes the call continue the
    cached sequences — incremental decoding gives the outputs of one full forward. Padded positions of
    the output are 0. With a :class:`PagedKVCache` (inference only), the first call may be padded or
    varlen; later calls are dense and run :func:`delta_attn.flash_attn_with_kvcache` on the pages (a
    decode step with static addresses, capturable in a CUDA graph on the Triton backend).

    >>> import torch, delta_attn.nn as dnn
    >>> attn = dnn.MultiheadAttention(64, num_heads=4, num_kv_heads=2, backend="torch")
    >>> attn(torch.randn(2, 5, 64)).shape
    torch.Size([2, 5, 64])
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, causal: bool = True, rotary: bool = True,
                 rope_theta: float = 10000.0, bias: bool = False, softmax_scale: Optional[float] = None,
                 window_size: Tuple[int, int] = (-1, -1), dropout: float = 0.0, backend: str = "auto",
                 layer_idx: Optional[int] = None):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        head_dim = head_dim or hidden_size // num_heads
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.causal, self.softmax_scale, self.window_size = causal, softmax_scale, tuple(window_size)
        self.dropout = dropout
        self.backend, self.layer_idx = backend, layer_idx
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.rotary = RotaryEmbedding(head_dim, rope_theta) if rotary else None

    def _attn_kwargs(self) -> dict:
        return dict(causal=self.causal, softmax_scale=self.softmax_scale, window_size=self.window_size,
                    dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if cu_seqlens is None:
            out = self._attend(q, k, v, attention_mask, cache)
        else:
            packing = make_packing(x, None, cu_seqlens, max_seqlen)
            if cache is None:
                out = self._attend_varlen(q[0], k[0], v[0], packing)[None]
            else:
                # with a cache, the packed sequences become the rows of a right-padded (N, L) batch
                n, L = packing.num_seqs, packing.max_seqlen
                rows = Packing(n, L, packing.cu_seqlens, L, packing.seq_ids * L + packing.positions,
                               packing.positions, packing.seq_ids)
                mask = rows.unpack(torch.ones(t, dtype=torch.bool, device=x.device))
                out = self._attend(rows.unpack(q[0]), rows.unpack(k[0]), rows.unpack(v[0]), mask, cache)
                out = rows.pack(out)[None]
        return self.o_proj(out.reshape(b, t, -1))

    def _attend_varlen(self, q, k, v, packing: Packing) -> torch.Tensor:
        if self.rotary is not None:
            q, k = self.rotary(q, packing.positions), self.rotary(k, packing.positions)
        cu, ms = packing.cu_seqlens, packing.max_seqlen
        return flash_attn_varlen_func(q, k, v, cu, cu, ms, ms, backend=self.backend, **self._attn_kwargs())

    def _attend(self, q, k, v, mask: Optional[torch.Tensor], cache) -> torch.Tensor:
        if isinstance(cache, PagedKVCache):
            return self._attend_paged(q, k, v, mask, cache)
        b, t = q.shape[:2]
        if mask is not None:
            mask = mask.bool()
            positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        else:
            positions = torch.arange(t, device=q.device).unsqueeze(0).expand(b, t)
        if cache is not None and not cache.empty:
            positions = positions + cache.seen.unsqueeze(1)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        kmask = mask
        if cache is not None:
            new = mask.sum(1) if mask is not None else torch.full((b,), t, device=q.device, dtype=torch.long)
            if not cache.empty:
                if cache.mask is not None or mask is not None:
                    old = cache.mask if cache.mask is not None else torch.ones(cache.k.shape[:2], dtype=torch.bool,
                                                                               device=q.device)
                    cur = mask if mask is not None else torch.ones(b, t, dtype=torch.bool, device=q.device)
                    kmask = torch.cat((old, cur), 1)
                k, v = torch.cat((cache.k, k), 1), torch.cat((cache.v, v), 1)
                new = new + cache.seen
            cache.k, cache.v, cache.mask, cache.seen = k, v, kmask, new
        return _masked_attention(q, k, v, mask, kmask, self.backend, **self._attn_kwargs())

    def _attend_paged(self, q, k, v, mask: Optional[torch.Tensor], cache: PagedKVCache) -> torch.Tensor:
        """First call: attention over the (padded) prompt, then its real keys / values go to the pages.
        Later calls: rotary at ``cache_seqlens + i``, then one ``flash_attn_with_kvcache`` call appends
        the new keys / values in place and attends over the pages; ``cache_seqlens`` advances in place."""
        b, t = q.shape[:2]
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        if cache.empty:
            cache.allocate(b, self.num_kv_heads, self.head_dim, k.dtype, k.device)
        elif cache.block_table.shape[0] != b:
            raise ValueError(f"the cache holds {cache.block_table.shape[0]} sequences, this call has {b}")
        first = not capturing and max(cache.host_len) == 0
        if mask is not None and not first:
            raise ValueError("attention_mask with a PagedKVCache is only accepted on the first (prefill) call; "
                             "later calls take dense (B, T) tokens")
        if not capturing:    # hand out pages on the host; a captured step uses pages reserved before capture
            cache.reserve(t)
            cache.advance(t)
        if first:
            if mask is not None:
                mask = mask.bool()
                positions = (mask.long().cumsum(1) - 1).clamp(min=0)
            else:
                positions = torch.arange(t, device=q.device).unsqueeze(0).expand(b, t)
            if self.rotary is not None:
                q, k = self.rotary(q, positions), self.rotary(k, positions)
            out = _masked_attention(q, k, v, mask, mask, self.backend, **self._attn_kwargs())
            cache.write(k, v, mask)
            return out
        if self.training and self.dropout > 0:
            raise ValueError("a PagedKVCache is for inference: dropout must be 0 or the layer in eval mode")
        positions = cache.cache_seqlens.long().unsqueeze(1) + torch.arange(t, device=q.device)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        out = flash_attn_with_kvcache(q, cache.k_pages, cache.v_pages, k.to(cache.k_pages.dtype),
                                      v.to(cache.v_pages.dtype), cache_seqlens=cache.cache_seqlens,
                                      block_table=cache.block_table, softmax_scale=self.softmax_scale,
                                      causal=self.causal, window_size=self.window_size, backend=self.backend)
        cache.cache_seqlens.add_(t)
        return out


class GQACrossAttention(nn.Module):
    """Grouped-query cross-attention: queries from ``x``, keys and values from a ``memory``.

    ``forward(x (B, T, C), memory (B, M, Cm), memory_mask=None, cache=None)``: every query sees
    every real memory entry (``memory_mask`` (B, M) marks them; a row with none returns 0 before the
    output projection). A :class:`CrossAttentionCache` keeps the projected memory, so later calls
    may pass ``memory=None``. Used as the "expert" attention of a mixture layer: a few kv heads shared
    by many query heads.

    >>> import torch, delta_attn.nn as dnn
    >>> xattn = dnn.GQACrossAttention(64, num_heads=8, num_kv_heads=2, memory_size=32, backend="torch")
    >>> xattn(torch.randn(2, 5, 64), torch.randn(2, 7, 32)).shape
    torch.Size([2, 5, 64])
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, memory_size: Optional[int] = None, bias: bool = False,
                 softmax_scale: Optional[float] = None, dropout: float = 0.0, backend: str = "auto"):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        head_dim = head_dim or hidden_size // num_heads
        memory_size = memory_size or hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.softmax_scale, self.dropout, self.backend = softmax_scale, dropout, backend
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(memory_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(memory_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, memory: Optional[torch.Tensor] = None, *,
                memory_mask: Optional[torch.Tensor] = None,
                cache: Optional[CrossAttentionCache] = None) -> torch.Tensor:
        b, t, _ = x.shape
        if cache is not None and not cache.empty:
            k, v, memory_mask = cache.k, cache.v, cache.memory_mask
        else:
            if memory is None:
                raise ValueError("memory is required unless a filled CrossAttentionCache is given")
            m = memory.shape[1]
            k = self.k_proj(memory).view(b, m, self.num_kv_heads, self.head_dim)
            v = self.v_proj(memory).view(b, m, self.num_kv_heads, self.head_dim)
            memory_mask = None if memory_mask is None else memory_mask.bool()
            if cache is not None:
                cache.k, cache.v, cache.memory_mask = k, v, memory_mask
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        out = _masked_attention(q, k, v, None, memory_mask, self.backend, causal=False,
                                softmax_scale=self.softmax_scale,
                                dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(out.reshape(b, t, -1))
