"""``backend="sdpa"``: PyTorch's own fused attention kernels behind the flash-attn 2 API.

* fp16 / bf16, dense and varlen: the FlashAttention-2 kernel PyTorch ships
  (``aten::_flash_attention_forward`` / ``_flash_attention_backward``, the kernel behind
  ``F.scaled_dot_product_attention``'s flash backend and ``torch.nn.attention.varlen.varlen_attn``).
  Its mask is flash-attn's: bottom-right causal, ``(left, right)`` window, GQA, Sq != Sk, LSE.
  A dense call runs as a varlen call with equal lengths (the (B, S, H, D) tensor *is* a packed
  (B*S, H, D) batch), so one kernel path serves both.
* float32, dense: the memory-efficient kernel (``aten::_scaled_dot_product_efficient_attention``),
  which PyTorch aligns causal masks top-left: it runs causal only when Sq == Sk, no window, no GQA.

No softcap, ALiBi, dropout or ``head_dim_v != head_dim`` (declared in the capabilities).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Tuple

import torch

from .flash.api import AttnArgs

# ---------------------------------------------------------------------------------------------
# capability helpers (pure Python; used by the registry in ops/cudnn.py)
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


def _cu_for_dense(batch: int, seqlen: int, device) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------------------
# FlashAttention-2 (fp16 / bf16)
# ---------------------------------------------------------------------------------------------


class SdpaFlashFunction(torch.autograd.Function):
    """FA2 varlen forward / backward on (T, H, D) views; returns (out, lse (Hq, Tq))."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, wl, wr):
        causal = wr == 0 and wl < 0
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
            window_size_left=wl, window_size_right=wr)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, unused)
        ctx.meta = (max_q, max_k, scale, wl, wr, causal)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k, rng_state, unused = ctx.saved_tensors
        max_q, max_k, scale, wl, wr, causal = ctx.meta
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused,
            scale=scale, window_size_left=wl, window_size_right=wr)
        return dq, dk, dv, None, None, None, None, None, None, None


def _flash(a: AttnArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    wl, wr = a.window
    if a.varlen is None:
        b, sq, hq, d = a.q.shape
        sk = a.k.shape[1]
        # (B, S, H, D) -> packed (B*S, H, D): a view when the tensor is contiguous
        q = a.q.reshape(b * sq, hq, d)
        k = a.k.reshape(b * sk, a.k.shape[2], d)
        v = a.v.reshape(b * sk, a.v.shape[2], a.v.shape[3])
        cu_q = _cu_for_dense(b, sq, q.device)
        cu_k = cu_q if sk == sq else _cu_for_dense(b, sk, q.device)
        out, lse = SdpaFlashFunction.apply(q, k, v, cu_q, cu_k, sq, sk, a.softmax_scale, wl, wr)
        out = out.view(b, sq, hq, -1)
        lse = lse.view(hq, b, sq).permute(1, 0, 2)
        return out, lse
    vl = a.varlen
    q, k, v = a.q, a.k, a.v
    if vl.layout == "htd":               # (H, T, D) -> a (T, H, D) view; FA2 takes any token/head stride
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out, lse = SdpaFlashFunction.apply(q, k, v, vl.cu_seqlens_q, vl.cu_seqlens_k, vl.max_seqlen_q,
                                       vl.max_seqlen_k, a.softmax_scale, wl, wr)
    if vl.layout == "htd":
        out = out.transpose(0, 1)
    return out, lse


# ---------------------------------------------------------------------------------------------
# memory-efficient kernel (float32 dense)
# ---------------------------------------------------------------------------------------------


def _efficient(a: AttnArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    b, sq, hq, _ = a.q.shape
    q, k, v = (t.transpose(1, 2) for t in (a.q, a.k, a.v))       # (B, H, S, D) views
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, a.causal, scale=a.softmax_scale)
    return out.transpose(1, 2), lse[..., :sq]


def attention(a: AttnArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """``backend="sdpa"`` implementation of flash / flash_varlen."""
    if a.q.dtype == torch.float32:
        return _efficient(a)
    return _flash(a)
