"""``backend="triton"`` for attention: launchers, ``torch.library`` custom ops, autograd.

Layers, bottom up (the pattern of every op, docs/ARCHITECTURE.md):
- :func:`flash_fwd` / :func:`flash_bwd` launch the kernels of ``kernels_fwd`` / ``kernels_bwd`` on a
  dense (B, S, H, D) batch or a packed one ("thd" (total, H, D) / "htd" (H, total, D), addressed
  through strides, never copied);
- ``delta_attn::flash_attn_fwd`` / ``delta_attn::flash_attn_bwd`` are ``torch.library`` custom ops
  with fake implementations, so ``torch.compile(fullgraph=True)`` traces through them;
- :class:`FlashAttnFunction` ties them together for autograd; :func:`attention` is the backend
  entry point that receives the validated :class:`~delta_attn.ops.flash.api.AttnArgs`: the Function
  when a gradient is needed, else the forward op's body in eager mode (the op while traced).

Determinism: the backward never uses atomics (dK/dV and dQ are separate passes and GQA groups are
summed in registers), so gradients are bit-identical across runs whether or not
``deterministic=True`` (the flag is accepted and changes nothing).

Dropout: a Philox counter stream keyed by a seed drawn from torch's generator of the device at
forward time (``torch.manual_seed`` makes it reproducible) and by (batch, head); the backward
regenerates the same mask from the saved seed. :func:`dropout_keep_mask` materialises it.

Autotuning (GPU only): keys are the head dim, the feature flags and power-of-two *buckets* of the
sequence lengths, never the raw lengths, so a varlen loop does not re-tune every step. Under
``TRITON_INTERPRET=1`` one small fixed configuration runs instead.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import triton

from ... import _outputs, settings
from .._launch import eager_or_op, index, optional, unit_last
from .api import AttnArgs
from .kernels_bwd import _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel, _flash_bwd_preprocess_kernel
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
# docs/PERFORMANCE.md.
# The forward tries K/V loads through TMA descriptors ("USE_TMA"), warp specialisation of the
# unmasked loop ("WS") and the loop software-pipelined by one key block ("PIPE") as tuning choices.
# Measured (sweep of 2026-11-21 03:14): PIPE with TMA is the fastest D=128 forward on all four issue
# shapes (+1..6% over the plain loop); PIPE without TMA is 10-17% slower (the plain loop stays as
# the choice when TMA is impossible: TMA_OK is an autotune key); at D=64 PIPE gained nothing.
# (TMA with 2 stages crashed ptxas; WS with 4 warps failed to compile on sm_90 with Triton 3.6.)
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
    _launch("fwd", L.d, "BLOCK_M", L.sq, L.batch * L.hq, args,
            dict(**L.scalars, **L.flags, REVERSE_M=L.reverse_m, PLAIN=L.plain,
                 TMA_OK=not settings.triton_interpreter() and _tma_ok(k, v)), config)
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
    # 2. dK, dV: one program per key block and key head
    sc = dict(L.scalars)
    n_heads, group = sc.pop("n_heads"), sc.pop("group")
    _launch("dkdv", L.d, "BLOCK_N", L.sk, L.batch * L.hk,
            (q, k, v, do, lse, delta, dk, dv, *common, *_strides(dk, layout), *_strides(dv, layout), *lse_s,
             *L.alibi_strides),
            dict(**sc, n_heads=n_heads, n_kv_heads=L.hk, group=group, **L.flags), dkdv_config)
    # 3. dQ: one program per query block and query head
    _launch("dq", L.d, "BLOCK_M", L.sq, L.batch * L.hq,
            (q, k, v, do, lse, delta, dq, *common, *_strides(dq, layout), *lse_s, *L.alibi_strides),
            dict(**L.scalars, **L.flags, REVERSE_M=L.reverse_m), dq_config)
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
# custom ops (torch.compile sees these as opaque nodes with fake implementations)
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
        out, lse, seed = torch.ops.delta_attn.flash_attn_fwd(q, k, v, cu_q, cu_k, max_sq, max_sk, layout, scale,
                                                             wl, wr, softcap, alibi, dropout_p)
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
        dq, dk, dv = torch.ops.delta_attn.flash_attn_bwd(dout, q, k, v, out, lse, seed, cu_q, cu_k, max_sq, max_sk,
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
        cu_q, cu_k, max_sq, max_sk, layout = vl.cu_seqlens_q, vl.cu_seqlens_k, vl.max_seqlen_q, vl.max_seqlen_k, vl.layout
    args = (a.q, a.k, a.v, cu_q, cu_k, int(max_sq), int(max_sk), layout, float(a.softmax_scale), int(wl), int(wr),
            float(a.softcap), a.alibi_slopes, float(a.dropout_p))
    if a.needs_grad():
        return FlashAttnFunction.apply(*args)
    out, lse, _ = eager_or_op(_fwd, _fwd_op)(*args)
    return out, lse


__all__: List[str] = ["flash_fwd", "flash_bwd", "FlashAttnFunction", "attention", "dropout_keep_mask",
                      "draw_dropout_seed"]
