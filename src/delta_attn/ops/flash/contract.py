"""What a fused attention backend (``sdpa``, ``cudnn``) needs before its kernel to compute the contract.

Both kernels families mask with -inf *before* they scale and take row maxima on raw scores, so a
scale <= 0 turns masked scores into +inf / NaN; and neither runs a call with no query rows or no
keys (FA2 rejects a zero total, cuDNN's ragged offsets need a nonzero step). :func:`prepare` turns
every call into one the kernel computes exactly, or answers it here:

* ``softmax_scale < 0`` runs as ``(-q, |scale|)`` (``scale · q kᵀ = |scale| · (−q) kᵀ``, negation is
  exact, autograd carries the sign to dq); ``softmax_scale == 0`` as ``(0 · q, 1)``: uniform weights
  over the visible keys.
* q, k and v are copied to a unit-stride head dimension with 16-byte aligned rows when they are not
  (PyTorch's CPU flash kernel reads the head dimension as if it were contiguous: wrong values or NaN; FA2
  and cuDNN load rows in 16-byte vectors: a padded view with an odd row stride gave "misaligned address"
  on the H200).
* No query rows, or no keys at all: out zeros and lse +inf (rows that see no key, docs/CONTRACT.md), built
  inside the autograd graph of q, k and v so their gradients are exact zeros.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from ...reference import accumulation_dtype
from .args import AttnArgs

INF = float("inf")


def positive_scale(q: torch.Tensor, scale: float) -> Tuple[torch.Tensor, float]:
    """(q', scale') with scale' > 0 and scale' · q' = scale · q."""
    if scale > 0:
        return q, scale
    if scale < 0:
        return -q, -scale
    return q * 0, 1.0


def no_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_shape,
            lse_shape) -> Tuple[torch.Tensor, torch.Tensor]:
    """Zeros of ``out_shape`` and +inf of ``lse_shape``, in the autograd graph of q, k and v (sums over an
    empty dimension are exact zeros: zero gradients)."""
    zero = q.reshape(-1)[:0].sum() + k.reshape(-1)[:0].sum() + v.reshape(-1)[:0].sum()
    out = zero.to(v.dtype).expand(*out_shape).contiguous()
    return out, torch.full(lse_shape, INF, dtype=accumulation_dtype(q.dtype), device=q.device)


def trivial(a: AttnArgs) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(out, lse) of a call with no query rows or no keys; None for every other call."""
    if a.varlen is None:
        b, sq, hq, _ = a.q.shape
        if b and sq and a.k.shape[1]:
            return None
        return no_keys(a.q, a.k, a.v, (b, sq, hq, a.v.shape[-1]), (b, hq, sq))
    tdim = 0 if a.varlen.layout == "thd" else 1
    tq, tk = a.q.shape[tdim], a.k.shape[tdim]
    if tq and tk:
        return None
    hq = a.heads[0]
    shape = (tq, hq, a.v.shape[-1]) if tdim == 0 else (hq, tq, a.v.shape[-1])
    return no_keys(a.q, a.k, a.v, shape, (hq, tq))


def _aligned(t: torch.Tensor) -> bool:
    """Unit-stride last dimension, every other stride and the start a multiple of 16 bytes (the start is not
    known while torch.compile traces: strides only there)."""
    vec = max(1, 16 // t.element_size())
    if t.stride(-1) != 1 or any(s % vec for s in t.stride()[:-1]):
        return False
    return torch.compiler.is_compiling() or t.data_ptr() % 16 == 0


def prepare(a: AttnArgs) -> Tuple[AttnArgs, Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """(the call with a positive scale, the answer when no kernel needs to run)."""
    done = trivial(a)
    if done is not None:
        return a, done
    q, scale = positive_scale(a.q, a.softmax_scale)
    q, k, v = (t if _aligned(t) else t.contiguous() for t in (q, a.k, a.v))
    if scale != a.softmax_scale or q is not a.q or k is not a.k or v is not a.v:
        a = dataclasses.replace(a, q=q, k=k, v=v, softmax_scale=scale)
    return a, None
