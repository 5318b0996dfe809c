"""``backend="triton"`` for ``flash_attn_with_kvcache``: the launcher, the ``torch.library`` custom op
``delta_attn::flash_kvcache`` (mutates the caches; with a fake) and the backend entry point.

One call is at most three launches on one stream, none of which reads a value on the host, so the call
can be captured in a CUDA graph: the append kernel (new keys / values into the cache, rotary on the
keys), the split-KV attention kernel, and, when the keys are split, the merge kernel. The number of
splits comes from the shapes only (:func:`choose_splits`), never from ``cache_seqlens``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton

from ... import _outputs, settings
from .._launch import Tiles, cdiv, eager_or_op, halving, index, launch, next_pow2, optional, param, sm_count, tiles
from .kernels_decode import _kvcache_append_kernel, _kvcache_attn_kernel, _kvcache_merge_kernel

Tensor = torch.Tensor


@dataclass(frozen=True)
class SplitRule:
    """How many programs share one sequence's keys when ``num_splits=0``."""
    # FA2's rule: once the (batch, key head, row block) programs fill 80 % of the SMs, splitting only adds
    # the merge pass
    fill: float = 0.8
    # otherwise aim at two programs per SM (each streams its key range: more in flight hides latency)
    programs_per_sm: int = 2
    # a split below this many keys costs more in its fixed work (q load, partial write) than it saves
    min_keys: int = 256
    max_splits: int = 64


SPLITS = SplitRule()


def choose_splits(programs: int, capacity: int, sms: int, rule: SplitRule = SPLITS) -> int:
    """Splits of the key range per program from the shapes: ``programs`` (batch x key heads x row blocks),
    ``capacity`` (cache positions per sequence) and the SM count."""
    if programs >= rule.fill * sms:
        return 1
    want = cdiv(rule.programs_per_sm * sms, max(programs, 1))
    return max(1, min(want, cdiv(capacity, rule.min_keys), rule.max_splits))


def _attn_tiles(d: int, paged: bool):
    """Key tiles of the attention kernel, by layout (measured on the H200 at B = 64, cache 8K, Hq 32, Hk 8,
    D = 128, bf16, graph replay; docs/PERFORMANCE.md): a contiguous cache streams 128-key tiles in 2 stages
    with only the edge tiles masked (492 µs, 1.016x cuDNN SDPA; 561 µs with the paged tiles); a paged cache
    keeps 64-key tiles in 3 stages, every tile masked (507 µs, 1.031x cuDNN paged; 691 µs with edge-only
    masks). Halved when shared memory is short. One small tile under the interpreter (CPU tests cover
    several tiles and splits)."""
    if settings.triton_interpreter():
        return _INTERP_ATTN_TILES
    return _device_attn_tiles(d, paged)


_INTERP_ATTN_TILES = (tiles("interpreter: small tiles", num_warps=4, num_stages=1, BLOCK_N=16, HOIST=0),)


@functools.lru_cache(maxsize=None)
def _device_attn_tiles(d: int, paged: bool) -> Tuple[Tiles, ...]:
    if paged:
        first = tiles("paged: 64-key tiles, 3 stages, every tile masked", num_warps=4, num_stages=3,
                      BLOCK_N=64 if d <= 128 else 32, HOIST=0)
    else:
        first = tiles("contiguous: 128-key tiles, 2 stages, edge tiles masked", num_warps=4, num_stages=2,
                      BLOCK_N=128 if d <= 128 else 64, HOIST=1)
    return halving(first, ("BLOCK_N",))


ATTN_META = ("BLOCK_N", "HOIST")


def check_attn_config(config: Tiles) -> None:
    """An explicit attention-kernel config: :class:`Tiles` with ``BLOCK_N`` (keys per tile, a power of two
    >= 16) and ``HOIST`` (1: only the tiles at the edges of the visible range are masked; 0: every tile)."""
    if not isinstance(config, Tiles):
        raise TypeError(f"config must be a delta_attn.ops._launch.Tiles or None, got {type(config).__name__}")
    meta = dict(config.meta)
    if sorted(meta) != sorted(ATTN_META):
        raise ValueError(f"config.meta must name exactly {ATTN_META}, got {tuple(sorted(meta))}")
    n = meta["BLOCK_N"]
    if not isinstance(n, int) or n < 16 or n & (n - 1):
        raise ValueError(f"config BLOCK_N must be a power of two >= 16, got {n!r}")
    if meta["HOIST"] not in (0, 1):
        raise ValueError(f"config HOIST must be 0 or 1, got {meta['HOIST']!r}")
    if config.num_warps not in (1, 2, 4, 8, 16) or not 1 <= config.num_stages <= 8:
        raise ValueError(f"config num_warps must be a power of two <= 16 and num_stages in [1, 8], got "
                         f"num_warps={config.num_warps}, num_stages={config.num_stages}")


def _row_block(rows: int) -> int:
    """Query rows (query x q head of one group) per program: all of them up to 64 (tl.dot needs >= 16)."""
    return max(16, min(64, next_pow2(max(rows, 1))))


def _s4(t: Optional[Tensor]) -> Tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0, 0, 0, 0)


def kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, alibi_slopes, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                rotary_interleaved: bool, rotary_per_query: bool, num_splits: int,
                config: Optional[Tiles] = None) -> Tuple[Tensor, Tensor]:
    """Append ``k`` / ``v`` to the caches (in place), then attend. Returns ``(out (B, Sq, Hq, D),
    lse (B, Hq, Sq) float32)``. Index tensors reach the kernels as contiguous int32 (the launch layer).
    ``config``: the attention kernel's tiles (:func:`check_attn_config`), launched as given (no smaller
    fallback); None: the default, fitted to the device."""
    if config is not None:
        check_attn_config(config)
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table = map(
        index, (cache_seqlens, cache_batch_idx, cache_leftpad, block_table))
    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    group = hq // hk
    paged = block_table is not None
    page = k_cache.shape[1]
    capacity = block_table.shape[1] * page if paged else k_cache.shape[1]
    rotary = rotary_cos is not None
    if rotary and rotary_sin.stride() != rotary_cos.stride():
        rotary_cos, rotary_sin = param(rotary_cos), param(rotary_sin)
    cos, sin = optional(rotary_cos, q), optional(rotary_sin, q)
    s_ro = tuple(rotary_cos.stride()) if rotary else (0, 0)
    seqlen_ro = rotary_cos.shape[0] if rotary else 1
    half = rotary_cos.shape[1] if rotary else 0
    bt = optional(block_table, cache_seqlens)
    s_bt = tuple(block_table.stride()) if paged else (0, 0)
    idx = optional(cache_batch_idx, cache_seqlens)
    block_d = max(16, next_pow2(d))
    common = dict(HEAD_DIM=d, BLOCK_D=block_d, PAGED=paged, HAS_IDX=cache_batch_idx is not None, ROTARY=rotary,
                  INTERLEAVED=bool(rotary_interleaved))

    # 1. new keys (rotated) and values into the cache
    snew = 0 if k is None else k.shape[1]
    if snew > 0 and b > 0:
        _kvcache_append_kernel[(b * snew, hk)](
            k, v, k_cache, v_cache, cache_seqlens, idx, bt, cos, sin, *_s4(k), *_s4(v), *_s4(k_cache), *_s4(v_cache),
            *s_bt, *s_ro, snew, page, seqlen_ro, half, **common)

    out = _outputs.empty((b, sq, hq, d), q.dtype, q.device)
    lse = _outputs.empty((b, hq, sq), torch.float32, q.device)
    if b == 0 or sq == 0:
        return out, lse
    # 2. split-KV attention: programs (row block x split, batch x key head)
    block_m = _row_block(sq * group)
    row_blocks = cdiv(sq * group, block_m)
    splits = num_splits or choose_splits(b * hk * row_blocks, capacity, sm_count(q.device))
    splits = max(1, min(splits, capacity))
    split = splits > 1
    # the splits' partial results (unused placeholders when the keys are not split)
    o_part = _outputs.empty((b * hq * sq * splits * d,), torch.float32, q.device) if split else optional(None, lse)
    l_part = _outputs.empty((b * hq * sq * splits,), torch.float32, q.device) if split else optional(None, lse)
    alibi = optional(alibi_slopes, q)
    s_ab = (0, 0) if alibi_slopes is None else (
        (0, alibi_slopes.stride(0)) if alibi_slopes.dim() == 1 else tuple(alibi_slopes.stride()))
    args = (q, k_cache, v_cache, out, lse, o_part, l_part, cache_seqlens,
            optional(cache_leftpad, cache_seqlens), idx, bt, alibi, cos, sin,
            *_s4(q), *_s4(k_cache), *_s4(v_cache), *_s4(out), *lse.stride(), *s_bt, *s_ab, *s_ro,
            sq, snew, hk, group, page, seqlen_ro, half, float(softmax_scale), float(softcap), int(window_left),
            int(window_right), splits, row_blocks)
    fixed = dict(common, BLOCK_M=block_m, HAS_LEFTPAD=cache_leftpad is not None, SOFTCAP=softcap > 0,
                 HAS_ALIBI=alibi_slopes is not None, HAS_WL=window_left >= 0, HAS_WR=window_right >= 0,
                 ROTARY_PER_QUERY=bool(rotary_per_query), SPLIT=split, IEEE=q.dtype == torch.float32)
    launch(_kvcache_attn_kernel, lambda t: (row_blocks * splits, b * hk), args, fixed,
           _attn_tiles(d, paged) if config is None else (config,))
    # 3. merge the splits
    if split:
        _kvcache_merge_kernel[(b * hq * sq,)](o_part, l_part, out, lse, *out.stride(), *lse.stride(), sq, hq, splits,
                                              HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=next_pow2(splits))
    return out, lse


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


def kvcache(a, config: Optional[Tiles] = None):
    """Backend entry point (a validated :class:`~delta_attn.ops.flash.kvcache.KVCacheArgs`): ``(out, lse)``.
    Through the one eager fast path (:func:`~delta_attn.ops._launch.eager_or_op`): eager calls launch directly
    (a decode step is launch-bound; the dispatcher would cost more than the kernels), traced calls go through
    the custom op. ``config``: explicit attention-kernel tiles (eager calls only; tuning experiments), see
    :func:`kvcache_fwd`."""
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
