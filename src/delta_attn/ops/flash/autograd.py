"""``backend="triton"`` for attention and ``flash_attn_with_kvcache``: the ``torch.library`` custom ops over the
launchers of ``launch.py``, the autograd Function and the backend entries (the wrapper pattern of every
operator, docs/ARCHITECTURE.md).

- ``delta_attn::flash_attn_fwd`` / ``delta_attn::flash_attn_bwd``, with fake implementations, so
  ``torch.compile(fullgraph=True)`` traces through them; :class:`FlashAttnFunction` ties them together for
  autograd; :func:`attention` is the entry of ``flash`` / ``flash_varlen`` that receives the validated
  :class:`~delta_attn.ops.flash.args.AttnArgs`: the Function when a gradient is needed, else the forward op's
  body in eager mode (the op while traced).
- ``delta_attn::flash_kvcache`` (mutates the caches; with a fake) and :func:`kvcache`, the entry of
  ``flash_kvcache`` (no backward).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._launch import Tiles, eager_or_op
from .args import AttnArgs, KVCacheArgs
from .launch import _lse_shape, draw_dropout_seed, flash_bwd, flash_fwd, kvcache_fwd

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------------
# attention: custom ops (torch.compile sees these as opaque nodes with fake implementations), autograd
# ---------------------------------------------------------------------------------------------


def _fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
         max_seqlen_q: int, max_seqlen_k: int, layout: str, softmax_scale: float, window_left: int,
         window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float
         ) -> Tuple[Tensor, Tensor, Tensor]:
    seed = draw_dropout_seed(q.device) if dropout_p > 0 else torch.zeros(1, dtype=torch.int64, device=q.device)
    out, lse = flash_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, softmax_scale,
                         window_left, window_right, softcap, alibi_slopes, dropout_p, seed)
    return out, lse, seed


_fwd_op = torch.library.custom_op("delta_attn::flash_attn_fwd", _fwd, mutates_args=())


@_fwd_op.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, softmax_scale,
              window_left, window_right, softcap, alibi_slopes, dropout_p):
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, layout), dtype=torch.float32)
    return out, lse, q.new_empty((1,), dtype=torch.int64)


def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
         cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
         layout: str, softmax_scale: float, window_left: int, window_right: int, softcap: float,
         alibi_slopes: Optional[Tensor], dropout_p: float, dlse: Optional[Tensor] = None
         ) -> Tuple[Tensor, Tensor, Tensor]:
    return flash_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout,
                     softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, dlse=dlse)


_bwd_op = torch.library.custom_op("delta_attn::flash_attn_bwd", _bwd, mutates_args=())


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout,
              softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class FlashAttnFunction(torch.autograd.Function):
    """Autograd of the Triton flash attention: forward and backward custom ops; out and lse are both
    differentiable (gradients not materialised: an unused lse costs the backward nothing)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_sq, max_sk, layout, scale, wl, wr, softcap, alibi, dropout_p):
        out, lse, seed = eager_or_op(_fwd, _fwd_op, q)(q, k, v, cu_q, cu_k, max_sq, max_sk, layout, scale, wl, wr,
                                                       softcap, alibi, dropout_p)
        ctx.save_for_backward(q, k, v, out, lse, seed, cu_q, cu_k, alibi)
        ctx.params = (max_sq, max_sk, layout, scale, wl, wr, softcap, dropout_p)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, seed, cu_q, cu_k, alibi = ctx.saved_tensors
        max_sq, max_sk, layout, scale, wl, wr, softcap, dropout_p = ctx.params
        if dout is None:            # only lse reached the loss
            dout = torch.zeros_like(out)
        dq, dk, dv = eager_or_op(_bwd, _bwd_op, dout)(dout, q, k, v, out, lse, seed, cu_q, cu_k, max_sq, max_sk,
                                                      layout, scale, wl, wr, softcap, alibi, dropout_p, dlse)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


def attention(a: AttnArgs):
    """Backend entry point (flash and flash_varlen): ``(out, lse)``."""
    wl, wr = a.window
    if a.varlen is None:
        cu_q = cu_k = None
        max_sq, max_sk, layout = a.q.shape[1], a.k.shape[1], "bshd"
    else:
        vl = a.varlen
        cu_q, cu_k, layout = vl.cu_seqlens_q, vl.cu_seqlens_k, vl.layout
        max_sq, max_sk = vl.max_seqlen_q, vl.max_seqlen_k
    args = (a.q, a.k, a.v, cu_q, cu_k, int(max_sq), int(max_sk), layout, float(a.softmax_scale), int(wl), int(wr),
            float(a.softcap), a.alibi_slopes, float(a.dropout_p))
    if a.needs_grad():
        return FlashAttnFunction.apply(*args)
    out, lse, _ = eager_or_op(_fwd, _fwd_op)(*args)
    return out, lse


# ---------------------------------------------------------------------------------------------
# KV-cache decode: the custom op (mutates the caches) and the backend entry
# ---------------------------------------------------------------------------------------------

_Opt = Optional[Tensor]


def _kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: _Opt, v: _Opt, rotary_cos: _Opt, rotary_sin: _Opt,
             cache_seqlens: Tensor, cache_batch_idx: _Opt, cache_leftpad: _Opt, block_table: _Opt,
             alibi_slopes: _Opt, softmax_scale: float, window_left: int, window_right: int, softcap: float,
             rotary_interleaved: bool, rotary_per_query: bool, num_splits: int) -> Tuple[Tensor, Tensor]:
    return kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       cache_leftpad, block_table, alibi_slopes, softmax_scale, window_left, window_right, softcap,
                       rotary_interleaved, rotary_per_query, num_splits)


_kvcache_op = torch.library.custom_op("delta_attn::flash_kvcache", _kvcache, mutates_args=("k_cache", "v_cache"))


@_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
      alibi_slopes, softmax_scale, window_left, window_right, softcap, rotary_interleaved, rotary_per_query,
      num_splits):
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=torch.float32)


def kvcache(a: KVCacheArgs, config: Optional[Tiles] = None):
    """Backend entry point (a validated :class:`~delta_attn.ops.flash.args.KVCacheArgs`): ``(out, lse)``.
    Through the one eager fast path (:func:`~delta_attn.ops._launch.eager_or_op`): eager calls launch directly
    (a decode step is launch-bound; the dispatcher would cost more than the kernels), traced calls go through
    the custom op. ``config``: explicit attention-kernel tiles (eager calls only; tuning experiments), see
    :func:`~delta_attn.ops.flash.launch.kvcache_fwd`."""
    wl, wr = a.window
    args = (a.q, a.k_cache, a.v_cache, a.k, a.v, a.rotary_cos, a.rotary_sin, a.cache_seqlens, a.cache_batch_idx,
            a.cache_leftpad, a.block_table, a.alibi_slopes, float(a.softmax_scale), int(wl), int(wr),
            float(a.softcap), bool(a.rotary_interleaved), bool(a.rotary_per_query), int(a.num_splits))
    if config is not None:
        if torch.compiler.is_compiling():
            raise ValueError("config is for eager calls only (the traced custom op uses the default tiles)")
        with torch.no_grad():
            return kvcache_fwd(*args, config=config)
    with torch.no_grad():
        return eager_or_op(_kvcache, _kvcache_op)(*args)
