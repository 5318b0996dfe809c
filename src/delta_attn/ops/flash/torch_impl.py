"""``backend="torch"`` for attention: the reference, with dropout masks drawn from torch's RNG."""
from __future__ import annotations

import torch

from ... import reference
from .args import AttnArgs


def _keep_mask(shape, p: float, device) -> torch.Tensor:
    return torch.rand(shape, device=device) >= p


def attention(a: AttnArgs):
    kw = dict(softmax_scale=a.softmax_scale, window_size=a.window, softcap=a.softcap,
              alibi_slopes=a.alibi_slopes, dropout_p=a.dropout_p)
    if a.varlen is None:
        b, sq, hq, _ = a.q.shape
        mask = _keep_mask((b, hq, sq, a.k.shape[1]), a.dropout_p, a.q.device) if a.dropout_p > 0 else None
        return reference.attention(a.q, a.k, a.v, dropout_mask=mask, **kw)
    vl = a.varlen
    masks = None
    if a.dropout_p > 0:
        hq = a.heads[0]
        lq = (vl.cu_seqlens_q[1:] - vl.cu_seqlens_q[:-1]).tolist()
        lk = (vl.cu_seqlens_k[1:] - vl.cu_seqlens_k[:-1]).tolist()
        masks = [_keep_mask((1, hq, x, y), a.dropout_p, a.q.device) for x, y in zip(lq, lk)]
    return reference.attention_varlen(a.q, a.k, a.v, vl.cu_seqlens_q, vl.cu_seqlens_k, dropout_masks=masks,
                                      layout=vl.layout, **kw)


def kvcache(a):
    """``flash_attn_with_kvcache`` on the reference (a :class:`~delta_attn.ops.flash.args.KVCacheArgs`).
    Reads the cache lengths on the host: not capturable in a CUDA graph (the Triton backend is)."""
    with torch.no_grad():
        return reference.attention_with_kvcache(
            a.q, a.k_cache, a.v_cache, a.k, a.v, cache_seqlens=a.cache_seqlens, rotary_cos=a.rotary_cos,
            rotary_sin=a.rotary_sin, cache_batch_idx=a.cache_batch_idx, cache_leftpad=a.cache_leftpad,
            block_table=a.block_table, softmax_scale=a.softmax_scale, causal=a.causal, window_size=a.window,
            softcap=a.softcap, rotary_interleaved=a.rotary_interleaved, alibi_slopes=a.alibi_slopes)
