"""``backend="sdpa"``: PyTorch's own attention kernels behind the flash-attn 2 API.

CUDA (capabilities declared in ``register.py``):

* fp16 / bf16, dense and varlen: the FlashAttention-2 kernel PyTorch ships
  (``aten::_flash_attention_forward`` / ``_flash_attention_backward``, the kernel behind
  ``F.scaled_dot_product_attention``'s flash backend and ``torch.nn.attention.varlen.varlen_attn``).
  Its mask is flash-attn's: bottom-right causal, ``(left, right)`` window, GQA, Sq != Sk, LSE.
  A dense call runs as a varlen call with equal lengths (the (B, S, H, D) tensor *is* a packed
  (B*S, H, D) batch), so one kernel path serves both.
* float32, dense: the memory-efficient kernel (``aten::_scaled_dot_product_efficient_attention``),
  which PyTorch aligns causal masks top-left: it runs causal only when Sq == Sk, no window, no GQA.

CPU (capabilities declared in ``register.py``, for CPU tensors):
``aten::_scaled_dot_product_flash_attention_for_cpu``, the kernel ``F.scaled_dot_product_attention`` runs on CPU
tensors: every float dtype (fp16 / bf16 inputs run in float32, out and gradients rounded once), any head dim (v's
equal to q's), GQA, an additive mask, the LSE and a backward. Causal with Sq == Sk runs its ``is_causal``
(top-left and bottom-right are the same mask there); any other causal or window call that excludes a key gets
an explicit (Sq, Sk) mask aligned bottom-right (``reference.attention_mask``). Varlen calls loop over the
sequences (``cu_seqlens`` read once).

What the wrapper adds so that every path computes the contract (docs/CONTRACT.md) exactly:

* **Rows that see no key** return zeros and lse = +inf. With a right bound ``wr >= 0`` they are the
  first ``Sq - Sk - wr`` rows of a sequence, all rows when Sk = 0 (a left bound ``wl >= 0`` never
  empties a row: ``i + Sk - Sq - wl <= Sk - 1`` for every row i). Dense calls run the kernel on the
  other rows only — bottom-right alignment does not change when rows are dropped from the top, and
  causal with Sq > Sk becomes square — and write the empty rows themselves; no kernel runs when Sk = 0.
  Varlen FA2 calls mark the rows on the device (no host synchronisation; not needed when
  ``cu_seqlens_q is cu_seqlens_k``) and overwrite them after the kernel, before out / lse are saved for
  the backward (lse = +inf gives those rows zero probabilities there); their dq is zeroed.
* **softmax_scale <= 0.** The kernels mask with -inf *before* they scale: FA2 masks the raw scores,
  takes the row maximum on them and computes ``exp2(s * scale * log2e - max * scale * log2e)``
  (flash_api.cpp / softmax.h); the memory-efficient kernel writes its causal -inf before it multiplies
  by the scale; the CPU kernel's ``is_causal`` does the same (measured here, torch 2.13: NaN rows for
  every scale <= 0, while its additive-mask and unmasked paths are right). A masked score then becomes
  +inf or NaN (-inf * 0), and FA2's raw maximum is the wrong end of the row (exp2 overflows once
  |scale| * spread is large): wrong results for masked calls and for some unmasked ones. Every
  kernel gets ``(-q, |scale|)`` instead: ``scale * q k^T = |scale| * (-q) k^T`` exactly (negation is
  exact in every dtype; autograd carries the sign to dq); a zero scale becomes ``(0 * q, 1)``, uniform
  weights over the visible keys.

No softcap, ALiBi, dropout or ``head_dim_v != head_dim`` (declared in ``register.py``).
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Tuple

import torch

from ... import reference
from ...reference import accumulation_dtype
from ...backends import UnsupportedError
from .args import AttnArgs
from .contract import INF as _INF, no_keys, prepare

# ---------------------------------------------------------------------------------------------
# what the registry asks (register.py declares the capabilities): which kernels this PyTorch exposes
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def flash_op_available() -> bool:
    """PyTorch exposes the FA2 varlen ops with window bounds (PyTorch >= 2.5-ish)."""
    try:
        fwd = torch.ops.aten._flash_attention_forward.default._schema
        bwd = torch.ops.aten._flash_attention_backward.default._schema
    except (AttributeError, RuntimeError):
        return False
    names = {a.name for a in fwd.arguments} & {a.name for a in bwd.arguments}
    return {"window_size_left", "window_size_right"} <= names


@lru_cache(maxsize=None)
def cpu_op_available() -> bool:
    """PyTorch exposes its CPU flash kernel with a mask argument (PyTorch >= 2.3-ish)."""
    try:
        schema = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default._schema
    except (AttributeError, RuntimeError):
        return False
    return "attn_mask" in {a.name for a in schema.arguments}


def empty_top_rows(sq: int, sk: int, wr: int) -> int:
    """How many of the first query rows see no key: query i sees one iff ``i + Sk - Sq + wr >= 0``
    (``wr < 0``: no right bound) and Sk > 0."""
    if sk == 0:
        return sq
    if wr < 0:
        return 0
    return min(sq, max(0, sq - sk - wr))


def _excludes_nothing(sq: int, sk: int, wl: int, wr: int) -> bool:
    """The window hides no key from any row: the last row's left bound and the first row's right
    bound already lie outside the keys."""
    return (wl < 0 or wl >= sk - 1) and (wr < 0 or wr >= sq - 1)


def _no_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A dense call whose rows all see no key: zeros and lse = +inf (contract.no_keys)."""
    b, sq, hq, _ = q.shape
    return no_keys(q, k, v, (b, sq, hq, v.shape[-1]), (b, hq, sq))


def _pad_top(out: torch.Tensor, lse: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prepend ``n`` rows that see no key to a dense (B, S, H, Dv) out and (B, H, S) lse."""
    b, _, h, dv = out.shape
    out = torch.cat([out.new_zeros(b, n, h, dv), out], 1)
    lse = torch.cat([lse.new_full((b, h, n), _INF), lse], 2)
    return out, lse


# ---------------------------------------------------------------------------------------------
# CPU: PyTorch's CPU flash kernel
# ---------------------------------------------------------------------------------------------


def _cpu_dense(q, k, v, scale: float, wl: int, wr: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, Sq, Hq, D) q, (B, Sk, Hk, D) k / v -> out (B, Sq, Hq, D), lse (B, Hq, Sq)."""
    b, sq, _, _ = q.shape
    sk = k.shape[1]
    n = empty_top_rows(sq, sk, wr)
    if n == sq or b == 0:
        return _no_keys(q, k, v)
    rows = q[:, n:] if n else q
    m = sq - n
    mask, causal = None, False
    if _excludes_nothing(m, sk, wl, wr):
        pass
    elif wl < 0 and wr == 0 and m == sk:
        causal = True
    else:
        hidden = ~reference.attention_mask(m, sk, (wl, wr), device=q.device)
        mask = torch.zeros(m, sk, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        rows.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=scale)
    out = out.transpose(1, 2)
    return _pad_top(out, lse, n) if n else (out, lse)


def _cpu(a: AttnArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    wl, wr = a.window
    q, scale, k, v = a.q, a.softmax_scale, a.k, a.v
    if q.dtype in (torch.float16, torch.bfloat16):
        # fp16 / bf16 run in float32: one rounding of out and of each gradient (the kernel's half-precision
        # backward rounds per query head before it sums GQA groups: 3.5x the error of the fp16 reference
        # seen), and its float16 path is slower (measured, one thread: forward 37 -> 27 ms, forward +
        # backward 691 -> 89 ms at S = 1024, H = 8, D = 64; bf16 within 20 % either way)
        out, lse = _cpu(dataclasses.replace(a, q=q.float(), k=k.float(), v=v.float(), softmax_scale=scale))
        return out.to(a.q.dtype), lse
    if a.varlen is None:
        return _cpu_dense(q, k, v, scale, wl, wr)
    vl = a.varlen
    if vl.layout == "htd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    cu_q = vl.cu_seqlens_q.tolist()
    cu_k = cu_q if vl.cu_seqlens_k is vl.cu_seqlens_q else vl.cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(vl.num_seqs):
        (q0, q1), (k0, k1) = cu_q[i:i + 2], cu_k[i:i + 2]
        o, l = _cpu_dense(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, wl, wr)
        outs.append(o[0])
        lses.append(l[0])
    hq, dv = q.shape[1], v.shape[2]
    out = torch.cat(outs, 0) if outs else q.new_zeros(0, hq, dv)
    lse = torch.cat(lses, 1) if lses else torch.zeros(hq, 0, dtype=accumulation_dtype(q.dtype), device=q.device)
    return (out.transpose(0, 1) if vl.layout == "htd" else out), lse


# ---------------------------------------------------------------------------------------------
# CUDA: FlashAttention-2 (fp16 / bf16)
# ---------------------------------------------------------------------------------------------


def _cu_for_dense(batch: int, seqlen: int, device) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def varlen_empty_rows(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, wr: int) -> torch.Tensor:
    """(total_q,) bool: the packed query rows that see no key, computed on the device (no sync)."""
    t = torch.arange(total_q, device=cu_q.device, dtype=cu_q.dtype)
    seq = torch.searchsorted(cu_q[1:], t, right=True)          # the sequence of each row
    pos = t - cu_q[seq]
    lq, lk = (cu_q[1:] - cu_q[:-1])[seq], (cu_k[1:] - cu_k[:-1])[seq]
    empty = lk == 0
    if wr >= 0:
        empty |= pos < lq - lk - wr
    return empty


class SdpaFlashFunction(torch.autograd.Function):
    """FA2 varlen forward / backward on (T, H, D) views; returns (out, lse (Hq, Tq)). ``empty`` (Tq,)
    bool marks the rows that see no key (None: none do): out 0, lse +inf, dq 0 there."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, wl, wr, empty):
        causal = wr == 0 and wl < 0
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
            window_size_left=wl, window_size_right=wr)
        if empty is not None:
            out = out.masked_fill(empty[:, None, None], 0.0)
            lse = lse.masked_fill(empty[None, :], _INF)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, unused, empty)
        ctx.meta = (max_q, max_k, scale, wl, wr, causal)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k, rng_state, unused, empty = ctx.saved_tensors
        max_q, max_k, scale, wl, wr, causal = ctx.meta
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused,
            scale=scale, window_size_left=wl, window_size_right=wr)
        if empty is not None:
            dq = dq.masked_fill(empty[:, None, None], 0.0)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _flash_max_k(max_q: int, max_k: int, wl: int, wr: int) -> int:
    """The ``max_seqlen_k`` FA2 is given. FA2 (flash_api.cpp) drops a window bound >= max_seqlen_k and
    replaces a missing bound of a local window by max_seqlen_k: query i of a sequence (lq, lk) then sees
    keys up to ``i + lk - lq + max_seqlen_k``, short of the last key once ``lq > max_seqlen_k + 1``
    (window (0, -1) with Sq = 257, Sk = 97 cut every row's keys). Passing ``max(max_k, max_q)`` makes
    both substitutions exact (a bound >= max(lq, lk) hides nothing); the kernel reads each sequence's
    own lengths from cu_seqlens, so only the backward's grid grows by blocks that exit at once."""
    local = wl >= 0 or wr > 0
    return max(max_k, max_q) if local else max_k


def _flash(a: AttnArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    wl, wr = a.window
    q, scale = a.q, a.softmax_scale
    if a.varlen is None:
        b, sq, hq, d = q.shape
        sk, hk = a.k.shape[1], a.k.shape[2]
        n = empty_top_rows(sq, sk, wr)
        if n == sq or b == 0:
            return _no_keys(a.q, a.k, a.v)
        m = sq - n
        # (B, S, H, D) -> packed (B*S, H, D): a view when the tensor is contiguous
        q = (q[:, n:] if n else q).reshape(b * m, hq, d)
        k = a.k.reshape(b * sk, hk, d)
        v = a.v.reshape(b * sk, hk, a.v.shape[3])
        cu_q = _cu_for_dense(b, m, q.device)
        cu_k = cu_q if sk == m else _cu_for_dense(b, sk, q.device)
        out, lse = SdpaFlashFunction.apply(q, k, v, cu_q, cu_k, m, _flash_max_k(m, sk, wl, wr), scale, wl, wr, None)
        out = out.view(b, m, hq, -1)
        lse = lse.view(hq, b, m).permute(1, 0, 2)
        return _pad_top(out, lse, n) if n else (out, lse)
    vl = a.varlen
    k, v = a.k, a.v
    if vl.layout == "htd":               # (H, T, D) -> a (T, H, D) view; FA2 takes any token/head stride
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    empty = None
    if vl.cu_seqlens_k is not vl.cu_seqlens_q:       # equal lengths: every row sees its own key
        empty = varlen_empty_rows(vl.cu_seqlens_q, vl.cu_seqlens_k, q.shape[0], wr)
    out, lse = SdpaFlashFunction.apply(q, k, v, vl.cu_seqlens_q, vl.cu_seqlens_k, vl.max_seqlen_q,
                                       _flash_max_k(vl.max_seqlen_q, vl.max_seqlen_k, wl, wr), scale, wl, wr, empty)
    if vl.layout == "htd":
        out = out.transpose(0, 1)
    return out, lse


# ---------------------------------------------------------------------------------------------
# CUDA: the memory-efficient kernel (float32 dense)
# ---------------------------------------------------------------------------------------------


def _efficient(a: AttnArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    q, scale = a.q, a.softmax_scale
    b, sq, hq, _ = q.shape
    sk = a.k.shape[1]
    n = empty_top_rows(sq, sk, a.window[1])
    if n == sq or b == 0:
        return _no_keys(a.q, a.k, a.v)
    m = sq - n
    # declared in the capabilities (register.py); the kernel's causal mask is top-left aligned
    if a.window != ((-1, 0) if a.causal else (-1, -1)) or hq != a.k.shape[2] or (a.causal and m != sk):
        raise UnsupportedError("sdpa's float32 CUDA path (memory-efficient kernel) has no window, GQA or "
                               "causal with Sq < Sk")
    qt, kt, vt = ((q[:, n:] if n else q).transpose(1, 2), a.k.transpose(1, 2), a.v.transpose(1, 2))
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        qt, kt, vt, None, True, 0.0, a.causal, scale=scale)
    out, lse = out.transpose(1, 2), lse[..., :m]
    return _pad_top(out, lse, n) if n else (out, lse)


def attention(a: AttnArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """``backend="sdpa"`` implementation of flash / flash_varlen."""
    a, done = prepare(a)
    if done is not None:
        return done
    if a.q.device.type == "cpu":
        return _cpu(a)
    if a.q.dtype == torch.float32:
        return _efficient(a)
    return _flash(a)
