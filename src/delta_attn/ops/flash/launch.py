"""Host launchers of the Triton attention kernels (``backend="triton"``): what each kernel receives, its tiles,
its grid.

Attention (``kernels_fwd.py``, ``kernels_bwd.py``): :func:`flash_fwd` / :func:`flash_bwd` on a dense
(B, S, H, D) batch or a packed one ("thd" (total, H, D) / "htd" (H, total, D), addressed through strides,
never copied); :func:`dropout_keep_mask` materialises the dropout mask of a seed.

* Determinism: the backward never uses atomics (dK/dV and dQ are separate passes and GQA groups are summed in
  registers), so gradients are bit-identical across runs whether or not ``deterministic=True`` (the flag is
  accepted and changes nothing).
* Dropout: a Philox counter stream keyed by a seed drawn from torch's generator of the device at forward time
  (``torch.manual_seed`` makes it reproducible) and by (batch, head); the backward regenerates the same mask
  from the saved seed.
* Autotuning (GPU only): keys are the head dim, the feature flags and power-of-two *buckets* of the sequence
  lengths, never the raw lengths, so a varlen loop does not re-tune every step. Under ``TRITON_INTERPRET=1``
  one small fixed configuration runs instead.

KV-cache decode (``kernels_decode.py``): :func:`kvcache_fwd` is at most three launches on one stream, none of
which reads a value on the host, so a call can be captured in a CUDA graph: the append kernel (new keys /
values into the cache, rotary on the keys), the split-KV attention kernel, and, when the keys are split, the
merge kernel. The number of splits comes from the shapes only (:func:`choose_splits`), never from
``cache_seqlens``.

The custom ops, the autograd Function and the backend entries over these launchers are in ``autograd.py``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import triton

from ... import _outputs, settings
from .._launch import (Tiles, cdiv, compile_configs, halving, index, launch, next_pow2, optional, param, sm_count,
                       tiles, unit_last)
from .kernels_bwd import _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel, _flash_bwd_preprocess_kernel
from .kernels_decode import _kvcache_append_kernel, _kvcache_attn_kernel, _kvcache_merge_kernel
from .kernels_fwd import _flash_dropout_mask_kernel, _flash_fwd_kernel

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------------
# configurations
# ---------------------------------------------------------------------------------------------


def _cfg(bm, bn, warps, stages, extra=None):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, **(extra or {})}, num_warps=warps, num_stages=stages)


_TMA = {"USE_TMA": True}
_PIPE_TMA = {"PIPE": True, "USE_TMA": True}
# (BLOCK_M, BLOCK_N, warps, stages[, extra meta]) per head-dim class, from the H200 sweeps in
# docs/PERFORMANCE.md ("Flash attention (Triton backend)").
# The forward tries K/V loads through TMA descriptors ("USE_TMA"), warp specialisation of the
# unmasked loop ("WS") and the loop software-pipelined by one key block ("PIPE") as tuning choices:
# PIPE with TMA is the fastest D=128 forward; without TMA PIPE is slower, so the plain loop stays as
# the choice when TMA is impossible (TMA_OK is an autotune key). TMA with 2 stages and WS with 4 warps
# do not build on sm_90 with Triton 3.6.
_FWD_CONFIGS = {
    64: [(128, 128, 4, 3, _TMA), (128, 64, 4, 3, _TMA), (128, 64, 8, 4), (128, 64, 4, 3)],
    128: [(128, 128, 8, 3, _PIPE_TMA), (128, 128, 8, 3), (64, 64, 4, 3, _TMA)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 64, 4, 3, _TMA)],
}
# dK/dV: BLOCK_N keys per program, BLOCK_M queries per inner step
_DKDV_CONFIGS = {
    64: [(64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 4, 2)],
    128: [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 4, 3)],
    256: [(32, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2), (16, 64, 4, 2)],
}
# dQ: BLOCK_M queries per program, BLOCK_N keys per inner step
_DQ_CONFIGS = {
    64: [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
    256: [(64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2)],
}
_FWD_META = {"USE_TMA": False, "WS": False, "PIPE": False}      # defaults of the forward's tuning meta-parameters
_INTERP_FWD = dict(BLOCK_M=16, BLOCK_N=16, **{**_FWD_META, "PIPE": True})
_INTERP_BWD = dict(BLOCK_M=16, BLOCK_N=16)

_FLAGS = ["IS_VARLEN", "SOFTCAP", "HAS_ALIBI", "HAS_DROPOUT", "HAS_WL", "HAS_WR", "HEAD_DIM"]


def _dclass(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


def _bucket(n: int) -> int:
    """Sequence-length bucket for autotune keys: a power of two in [64, 16384]."""
    return min(max(triton.next_power_of_2(max(int(n), 1)), 64), 16384)


@functools.lru_cache(maxsize=None)
def _tuned(kind: str, dclass: int):
    kernel, table, key = {
        "fwd": (_flash_fwd_kernel, _FWD_CONFIGS, ["SQ_BUCKET", "SK_BUCKET", "REVERSE_M", "PLAIN", "TMA_OK"] + _FLAGS),
        "dkdv": (_flash_bwd_dkdv_kernel, _DKDV_CONFIGS, ["SQ_BUCKET", "SK_BUCKET", "group"] + _FLAGS),
        "dq": (_flash_bwd_dq_kernel, _DQ_CONFIGS, ["SQ_BUCKET", "SK_BUCKET", "REVERSE_M"] + _FLAGS),
    }[kind]
    configs = [_cfg(*c[:4], {**_FWD_META, **(c[4] if len(c) > 4 else {})} if kind == "fwd" else None)
               for c in table[dclass]]
    return triton.autotune(configs, key=key)(kernel)


_KERNELS = {"fwd": _flash_fwd_kernel, "dkdv": _flash_bwd_dkdv_kernel, "dq": _flash_bwd_dq_kernel}


@functools.lru_cache(maxsize=None)
def _set_allocator() -> None:
    """Global scratch for device-side TMA descriptors (128 bytes per program)."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def _tma_ok(*tensors) -> bool:
    """TMA needs Hopper+, 16-byte aligned bases and 16-byte multiples for every non-unit stride."""
    t0 = tensors[0]
    if t0.device.type != "cuda" or torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16 or any((st * es) % 16 for st in t.stride()[:-1]):
            return False
    return True


def _autotunes(config: Optional[tuple], rows: int, grid_b: int) -> bool:
    """Whether :func:`_launch` will autotune (GPU, no fixed configuration, a non-empty grid)."""
    return config is None and rows > 0 and grid_b > 0 and not settings.triton_interpreter()


def _launch(kind: str, d: int, grid_m: str, rows: int, grid_b: int, args: tuple, kwargs: dict,
            config: Optional[tuple] = None) -> None:
    """Launch kernel ``kind``: grid (cdiv(rows, block), grid_b); autotuned on GPU, fixed under the
    interpreter. ``grid_m`` names the meta-parameter that tiles ``rows``. ``config`` (one entry of the
    kind's table: BLOCK_M, BLOCK_N, warps, stages[, forward meta]) runs that configuration untuned."""
    if rows == 0 or grid_b == 0:
        return
    kernel = _KERNELS[kind]
    if settings.triton_interpreter():
        meta = _INTERP_FWD if kind == "fwd" else _INTERP_BWD
        kernel[(triton.cdiv(rows, meta[grid_m]), grid_b)](*args, **kwargs, **meta)
        return
    if kwargs.get("TMA_OK"):
        _set_allocator()
    if config is not None:
        bm, bn, warps, stages = config[:4]
        meta = dict(BLOCK_M=bm, BLOCK_N=bn)
        if kind == "fwd":
            meta.update(_FWD_META, **(config[4] if len(config) > 4 else {}))
        kernel[(triton.cdiv(rows, meta[grid_m]), grid_b)](*args, **kwargs, **meta, num_warps=warps,
                                                          num_stages=stages)
        return
    _tuned(kind, _dclass(d))[lambda meta: (triton.cdiv(rows, meta[grid_m]), grid_b)](*args, **kwargs)


_COMPILED_KEYS: set = set()


def _compile_ahead(launches: Sequence[tuple]) -> None:
    """Before launches (:func:`_launch`'s arguments) that will autotune a key not seen yet (GPU), compile all
    their configurations concurrently (``compile_configs``), so the autotuner's benchmark finds them compiled."""
    jobs = []
    for kind, d, _, rows, grid_b, args, kwargs, config in launches:
        if not _autotunes(config, rows, grid_b):
            continue
        tuned = _tuned(kind, _dclass(d))
        key = (kind, _dclass(d), tuple(kwargs.get(n) for n in tuned.keys),
               tuple(a.dtype for a in args if isinstance(a, Tensor)))
        if key not in _COMPILED_KEYS:
            _COMPILED_KEYS.add(key)
            jobs.append((_KERNELS[kind], args, kwargs, tuned.configs))
    compile_configs(jobs)


def _launch_all(launches: Sequence[tuple]) -> None:
    """:func:`_launch` each of ``launches`` in order, their new autotune keys compiled together first."""
    _compile_ahead(launches)
    for one in launches:
        _launch(*one)


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------


def _strides(x: Tensor, layout: str) -> Tuple[int, int, int]:
    """(batch, token, head) strides; the dim stride is 1 (callers make sure of it)."""
    if layout == "bshd":
        return x.stride(0), x.stride(1), x.stride(2)
    if layout == "thd":
        return 0, x.stride(0), x.stride(1)
    return 0, x.stride(1), x.stride(0)     # "htd"


def _dims(q: Tensor, k: Tensor, layout: str):
    """(batch or num_seqs placeholder, Hq, Hk, total_q)"""
    if layout == "bshd":
        return q.shape[2], k.shape[2], q.shape[1]
    if layout == "thd":
        return q.shape[1], k.shape[1], q.shape[0]
    return q.shape[0], k.shape[0], q.shape[1]


def _lse_shape(q: Tensor, layout: str) -> Tuple[int, ...]:
    if layout == "bshd":
        return (q.shape[0], q.shape[2], q.shape[1])
    if layout == "thd":
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[1])


def _lse_strides(lse: Tensor, layout: str) -> Tuple[int, int, int]:
    if layout == "bshd":
        return lse.stride(0), lse.stride(1), lse.stride(2)
    return 0, lse.stride(0), lse.stride(1)


class _Launch:
    """Everything the three kernels share for one call (pointers, strides, lengths, flags)."""

    def __init__(self, q, k, v, cu_q, cu_k, max_sq, max_sk, layout, scale, wl, wr, softcap, alibi,
                 dropout_p, seed):
        self.layout = layout
        self.varlen = layout != "bshd"
        hq, hk, _ = _dims(q, k, layout)
        self.hq, self.hk = hq, hk
        self.batch = q.shape[0] if not self.varlen else cu_q.numel() - 1
        self.sq = q.shape[1] if not self.varlen else max_sq
        self.sk = k.shape[1] if not self.varlen else max_sk
        self.d = q.shape[-1]
        self.cu_q = optional(index(cu_q), q)
        self.cu_k = self.cu_q if cu_k is cu_q else optional(index(cu_k), q)
        self.alibi = optional(alibi, q)           # read through its strides
        self.alibi_strides = (0, 0) if alibi is None else (
            (0, alibi.stride(0)) if alibi.dim() == 1 else (alibi.stride(0), alibi.stride(1)))
        self.seed = optional(seed, q)
        self.scalars = dict(seqlen_q=self.sq, seqlen_k=self.sk, rng_stride=self.sk, n_heads=hq,
                            group=hq // hk, scale=float(scale), softcap=float(softcap), wl=int(wl), wr=int(wr),
                            dropout_p=float(dropout_p), SQ_BUCKET=_bucket(self.sq), SK_BUCKET=_bucket(self.sk))
        self.flags = dict(IS_VARLEN=self.varlen, SOFTCAP=softcap > 0, HAS_ALIBI=alibi is not None,
                          HAS_DROPOUT=dropout_p > 0, HAS_WL=wl >= 0, HAS_WR=wr >= 0, HEAD_DIM=self.d,
                          BLOCK_D=max(16, triton.next_power_of_2(self.d)))
        # causal-like calls: heaviest query blocks first
        self.reverse_m = wr >= 0 and wl < 0
        # forward fast path: the scale folds into one FMA after the row max of the raw scores
        self.plain = softcap <= 0 and alibi is None and scale > 0


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def flash_fwd(q, k, v, cu_q=None, cu_k=None, max_sq=0, max_sk=0, layout="bshd", scale=1.0, wl=-1, wr=-1,
              softcap=0.0, alibi=None, dropout_p=0.0, seed=None, config=None) -> Tuple[Tensor, Tensor]:
    """Forward pass. Returns ``(out in q's layout, lse float32)``; ``seed`` (1,) int64 on the device
    when ``dropout_p > 0``. ``config``: one entry of ``_FWD_CONFIGS`` run untuned (GPU; tests, sweeps)."""
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    L = _Launch(q, k, v, cu_q, cu_k, max_sq, max_sk, layout, scale, wl, wr, softcap, alibi, dropout_p, seed)
    out = _outputs.empty(q.shape, q.dtype, q.device)
    lse = _outputs.empty(_lse_shape(q, layout), torch.float32, q.device)
    args = (q, k, v, out, lse, L.cu_q, L.cu_k, L.alibi, L.seed,
            *_strides(q, layout), *_strides(k, layout), *_strides(v, layout), *_strides(out, layout),
            *_lse_strides(lse, layout), *L.alibi_strides)
    kwargs = dict(**L.scalars, **L.flags, REVERSE_M=L.reverse_m, PLAIN=L.plain,
                  TMA_OK=not settings.triton_interpreter() and _tma_ok(k, v))
    _launch_all([("fwd", L.d, "BLOCK_M", L.sq, L.batch * L.hq, args, kwargs, config)])
    return out, lse


def flash_bwd(do, q, k, v, out, lse, cu_q=None, cu_k=None, max_sq=0, max_sk=0, layout="bshd", scale=1.0,
              wl=-1, wr=-1, softcap=0.0, alibi=None, dropout_p=0.0, seed=None, dkdv_config=None,
              dq_config=None, dlse=None) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward pass: ``(dq, dk, dv)`` in the layouts of q, k, v (dK/dV summed over GQA groups).
    ``dlse``: the gradient of lse (its shape), or None for none. ``dkdv_config`` / ``dq_config``:
    entries of ``_DKDV_CONFIGS`` / ``_DQ_CONFIGS`` run untuned (GPU)."""
    do, q, k, v, out = (unit_last(t) for t in (do, q, k, v, out))
    L = _Launch(q, k, v, cu_q, cu_k, max_sq, max_sk, layout, scale, wl, wr, softcap, alibi, dropout_p, seed)
    dq = _outputs.empty(q.shape, q.dtype, q.device)
    dk = _outputs.empty(k.shape, k.dtype, k.device)
    dv = _outputs.empty(v.shape, v.dtype, v.device)
    delta = _outputs.empty(lse.shape, torch.float32, q.device)
    lse_s = _lse_strides(lse, layout)
    # 1. delta = rowsum(dO * O)
    if L.sq > 0 and L.batch * L.hq > 0:
        pre_m = 64
        _flash_bwd_preprocess_kernel[(triton.cdiv(L.sq, pre_m), L.batch * L.hq)](
            out, do, delta, L.cu_q, *_strides(out, layout), *_strides(do, layout), *lse_s, L.sq, L.hq,
            IS_VARLEN=L.varlen, HEAD_DIM=L.d, BLOCK_D=L.flags["BLOCK_D"], BLOCK_M=pre_m)
    # 1b. the LSE's gradient: d lse_i / d s_ij = p_ij, so dS = P (dP - delta) gains P dlse, i.e. delta -= dlse.
    # Rows that see no key (lse = +inf, p = 0) keep delta finite: their dlse is ignored (no inf - inf, no NaN).
    if dlse is not None:
        delta.sub_(torch.where(lse == float("inf"), 0.0, dlse))
    common = (L.cu_q, L.cu_k, L.alibi, L.seed, *_strides(q, layout), *_strides(k, layout), *_strides(v, layout),
              *_strides(do, layout))
    sc = dict(L.scalars)
    n_heads, group = sc.pop("n_heads"), sc.pop("group")
    # 2. dK, dV: one program per key block and key head; 3. dQ: one program per query block and query head
    _launch_all([
        ("dkdv", L.d, "BLOCK_N", L.sk, L.batch * L.hk,
         (q, k, v, do, lse, delta, dk, dv, *common, *_strides(dk, layout), *_strides(dv, layout), *lse_s,
          *L.alibi_strides),
         dict(**sc, n_heads=n_heads, n_kv_heads=L.hk, group=group, **L.flags), dkdv_config),
        ("dq", L.d, "BLOCK_M", L.sq, L.batch * L.hq,
         (q, k, v, do, lse, delta, dq, *common, *_strides(dq, layout), *lse_s, *L.alibi_strides),
         dict(**L.scalars, **L.flags, REVERSE_M=L.reverse_m), dq_config)])
    if L.sk == 0 or L.batch * L.hk == 0:
        dk.zero_()
        dv.zero_()
    if L.sq == 0 or L.batch * L.hq == 0:
        dq.zero_()
    return dq, dk, dv


def draw_dropout_seed(device) -> Tensor:
    """The dropout seed of one forward call: (1,) int64 drawn from the device's torch generator."""
    return torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64, device=device)


def dropout_keep_mask(seed: Tensor, batch: int, heads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                      rng_stride: Optional[int] = None) -> Tensor:
    """The keep-mask (batch, heads, seqlen_q, seqlen_k) bool the kernels use for ``seed``. For a
    varlen call pass ``batch = num_seqs``, the max lengths and ``rng_stride = max_seqlen_k``; sequence
    b's mask is ``[b, :, :Sq_b, :Sk_b]``."""
    mask = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.int8, device=seed.device)
    if mask.numel():
        bm = bn = 16 if settings.triton_interpreter() else 64
        _flash_dropout_mask_kernel[(triton.cdiv(seqlen_q, bm), triton.cdiv(seqlen_k, bn), batch * heads)](
            seed, mask, seqlen_q, seqlen_k, seqlen_k if rng_stride is None else rng_stride, float(dropout_p),
            BLOCK_M=bm, BLOCK_N=bn)
    return mask.bool()

# ---------------------------------------------------------------------------------------------
# KV-cache decode (flash_attn_with_kvcache)
# ---------------------------------------------------------------------------------------------


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
