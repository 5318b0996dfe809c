"""Building blocks shared by the layers: packing of padded / varlen batches, RMSNorm, rotary
embeddings and the short causal depthwise convolution of the linear-attention layers.

Token layouts a layer accepts (``x`` is always (B, T, C)):
  dense    no mask: every token is real;
  padded   ``attention_mask`` (B, T), 1/True marks a real token (left, right or any padding);
  varlen   ``cu_seqlens`` int32 (N + 1,) with B == 1: N sequences packed back to back.
A :class:`Packing` turns the padded and varlen layouts into one packed (total, ...) token list with
``cu_seqlens``, so that the operators run on real tokens only, and scatters results back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..reference import accumulation_dtype


# ---------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------

@dataclass
class Packing:
    """Real tokens of a batch, packed.

    ``indices`` (total,) are the positions of the real tokens in the flattened (B * T) batch (None:
    every token of a B == 1 varlen batch is real, in order). ``cu_seqlens`` int32 (N + 1,) splits the
    packed tokens into sequences; ``max_seqlen`` is an upper bound of their lengths (an int known on
    the host, so nothing waits for the device); ``positions`` (total,) is each token's index inside
    its sequence (counting only the tokens of this call).
    """
    batch: int
    seqlen: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    indices: Optional[torch.Tensor]
    positions: torch.Tensor
    seq_ids: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (total, ...)"""
        flat = x.reshape(self.batch * self.seqlen, *x.shape[2:])
        return flat if self.indices is None else flat.index_select(0, self.indices)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """(total, ...) -> (B, T, ...) with zeros at the padding."""
        if self.indices is None:
            return y.reshape(self.batch, self.seqlen, *y.shape[1:])
        out = y.new_zeros(self.batch * self.seqlen, *y.shape[1:])
        out = out.index_copy(0, self.indices, y)
        return out.view(self.batch, self.seqlen, *y.shape[1:])


def _positions(cu_seqlens: torch.Tensor, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(total, device=cu_seqlens.device)
    seq_ids = torch.searchsorted(cu_seqlens[1:].long(), t, right=True)
    return t - cu_seqlens.long()[seq_ids], seq_ids


def packing_from_mask(mask: torch.Tensor) -> Packing:
    """Padded batch -> packing. ``mask`` (B, T) bool/int, true at real tokens (any padding side)."""
    mask = mask.bool()
    b, t = mask.shape
    lengths = mask.sum(1, dtype=torch.int32)
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    indices = mask.flatten().nonzero().squeeze(1)
    pos, seq_ids = _positions(cu, indices.numel())
    return Packing(b, t, cu, t, indices, pos, seq_ids)


def packing_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int, max_seqlen: Optional[int]) -> Packing:
    """Varlen batch (B == 1, ``total`` tokens) -> packing."""
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    pos, seq_ids = _positions(cu_seqlens, total)
    return Packing(1, total, cu_seqlens, int(max_seqlen), None, pos, seq_ids)


def dense_packing(batch: int, seqlen: int, device) -> Packing:
    """A dense batch seen as B sequences of T tokens (static shapes: nothing reads the device)."""
    cu = torch.arange(batch + 1, device=device, dtype=torch.int32) * seqlen
    pos = torch.arange(seqlen, device=device).repeat(batch)
    seq_ids = torch.arange(batch, device=device).repeat_interleave(seqlen)
    return Packing(batch, seqlen, cu, seqlen, None, pos, seq_ids)


def make_packing(x: torch.Tensor, attention_mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                 max_seqlen: Optional[int]) -> Optional[Packing]:
    """The packing of a call, or None for a dense batch."""
    if attention_mask is not None and cu_seqlens is not None:
        raise ValueError("pass either attention_mask (padded batch) or cu_seqlens (packed batch), not both")
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {x.shape[0]}")
        return packing_from_cu_seqlens(cu_seqlens, x.shape[1], max_seqlen)
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"attention_mask must have shape (B, T) = {tuple(x.shape[:2])}, "
                             f"got {tuple(attention_mask.shape)}")
        return packing_from_mask(attention_mask)
    return None


# ---------------------------------------------------------------------------------------------
# normalisation, rotary embeddings
# ---------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(y.dtype)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """Kimi Linear's output gate: ``RMSNorm(o) * sigmoid(gate)`` per head."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.sigmoid(gate)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout, as Llama), applied to (..., T, H, D) tensors."""

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary dim must be even, got {dim}")
        self.dim = dim
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., T, H, D), positions (..., T) integer -> x rotated (first ``dim`` channels)."""
        dt = accumulation_dtype(x.dtype)
        freqs = positions.to(dt).unsqueeze(-1) * self.inv_freq.to(dt)       # (..., T, dim/2)
        emb = torch.cat((freqs, freqs), -1).unsqueeze(-2)                    # (..., T, 1, dim)
        cos, sin = emb.cos(), emb.sin()
        rot, rest = x[..., :self.dim].to(dt), x[..., self.dim:]
        x1, x2 = rot.chunk(2, -1)
        rotated = rot * cos + torch.cat((-x2, x1), -1) * sin
        return torch.cat((rotated.to(x.dtype), rest), -1)


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def init_decay_params(A_log: torch.Tensor, dt_bias: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1):
    """Mamba-style initialisation of the gate: A in [1, 16], softplus(dt_bias) log-uniform in [dt_min, dt_max]."""
    with torch.no_grad():
        A_log.copy_(torch.empty_like(A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(dt_bias).uniform_(math.log(dt_min), math.log(dt_max)))
        dt_bias.copy_(inverse_softplus(dt.clamp(min=1e-4)))


# ---------------------------------------------------------------------------------------------
# short causal depthwise convolution (varlen-aware, with a cache of the last W - 1 inputs)
# ---------------------------------------------------------------------------------------------

class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution of kernel ``W`` + SiLU over packed sequences.

    ``forward(x (total, C), packing, state)``: token t of sequence n sees its own last W inputs;
    inputs before the start of the sequence come from ``state`` (N, W - 1, C) (the last W - 1 inputs
    of the sequence's past, oldest first) or are zero. Returns ``(y (total, C), new_state (N, W - 1, C))``.
    Written as a gather of each token's window, so it needs no host synchronisation and compiles.
    """

    def __init__(self, channels: int, kernel_size: int = 4, activation: bool = True):
        super().__init__()
        if kernel_size < 2:
            raise ValueError(f"kernel_size must be >= 2, got {kernel_size}")
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels))
        nn.init.uniform_(self.weight, -kernel_size ** -0.5, kernel_size ** -0.5)

    def forward(self, x: torch.Tensor, packing: Packing, state: Optional[torch.Tensor] = None):
        w = self.kernel_size
        n = packing.num_seqs
        total = x.shape[0]
        if state is None:
            state = x.new_zeros(n, w - 1, x.shape[1])
        state = state.to(x.dtype)
        # source rows: the N * (W - 1) cached inputs first, then the packed tokens
        src = torch.cat((state.reshape(n * (w - 1), -1), x), 0)
        base = n * (w - 1)
        shift = torch.arange(w - 1, -1, -1, device=x.device)                       # W-1 .. 0 (oldest first)
        p = packing.positions.unsqueeze(1) - shift                                   # (total, W)
        own = torch.arange(total, device=x.device).unsqueeze(1) - shift + base
        cached = packing.seq_ids.unsqueeze(1) * (w - 1) + (w - 1) + p
        window = src.index_select(0, torch.where(p >= 0, own, cached).reshape(-1)).view(total, w, -1)
        y = torch.einsum("twc,cw->tc", window, self.weight.to(x.dtype)) + self.bias.to(x.dtype)
        if self.activation:
            y = F.silu(y)
        # new state: the last W - 1 inputs of each sequence (its past included)
        j = torch.arange(w - 1, device=x.device)
        lengths = packing.lengths.unsqueeze(1)                                       # (N, 1)
        q = lengths - (w - 1) + j                                                    # index within this call
        starts = packing.cu_seqlens[:-1].long().unsqueeze(1)
        seq = torch.arange(n, device=x.device).unsqueeze(1)
        idx = torch.where(q >= 0, base + starts + q, seq * (w - 1) + (w - 1) + q)
        new_state = src.index_select(0, idx.reshape(-1)).view(n, w - 1, -1)
        return y, new_state
