"""Linear-attention layers: Kimi Delta Attention (as in Kimi Linear) and gated diagonal attention.

Both share one shape: q/k/v projections -> short causal depthwise convolution (kernel 4) + SiLU ->
the recurrent operator (chunked over whole sequences, recurrent step when decoding) -> output gate
``sigmoid(low-rank(x)) * RMSNorm(o)`` per head -> output projection. Padded batches and varlen
batches are packed so that the operators only see real tokens (one ``cu_seqlens`` call); a
:class:`RecurrentCache` carries the convolution inputs and the recurrent state from call to call.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.diag.api import gated_diag_attn, gated_diag_step
from ..ops.kda.api import kda, kda_step
from ..reference import accumulation_dtype
from ._utils import GatedRMSNorm, ShortConvolution, dense_packing, init_decay_params, make_packing
from .cache import RecurrentCache

# decode calls with at most this many new tokens per sequence (and no grad) use the step kernels
MAX_STEP_TOKENS = 8


def _low_rank(d_in: int, rank: int, d_out: int, bias: bool) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=bias))


def _fp32_param(p: torch.Tensor) -> torch.Tensor:
    """The gate parameters enter the operators in their accumulation dtype: float32 (float64 kept for float64
    models); ``p`` itself when it already is."""
    return p.to(accumulation_dtype(p.dtype))


class _RecurrentLayer(nn.Module):
    """Packing, short convolution, output gate and cache handling shared by the linear layers.

    Subclasses define ``q_dim``, ``k_dim``, ``v_dim`` (projection widths), ``num_v_heads``,
    ``head_v_dim`` and ``_mix(x, q, k, v, run) -> o`` that calls the operator.
    """

    def _build_common(self, hidden_size: int, conv_size: int, use_short_conv: bool, gate_rank: int,
                      norm_eps: float):
        self.q_proj = nn.Linear(hidden_size, self.q_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.k_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.v_dim, bias=False)
        self.use_short_conv = use_short_conv
        # one depthwise convolution over the q, k and v channels side by side (one cache tensor)
        self.conv = ShortConvolution(self.q_dim + self.k_dim + self.v_dim, conv_size) if use_short_conv else None
        self.g_proj = _low_rank(hidden_size, gate_rank, self.v_dim, bias=True)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.v_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                cache: Optional[RecurrentCache] = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). ``attention_mask`` (B, T) marks real tokens (their outputs do not
        depend on the padding; padded outputs are 0); ``cu_seqlens`` int32 (N + 1,) with B == 1 runs
        packed sequences; ``cache`` continues (and is updated with) the cached sequences."""
        b, t, _ = x.shape
        packing = make_packing(x, attention_mask, cu_seqlens, max_seqlen)
        pk = packing if packing is not None else dense_packing(b, t, x.device)
        if cache is not None and not cache.empty and cache.state.shape[0] != pk.num_seqs:
            raise ValueError(f"the cache holds {cache.state.shape[0]} sequences, this call has {pk.num_seqs}")
        qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), -1)
        qkv = pk.pack(qkv)                                                     # (total, C)
        conv_state = None
        if self.conv is not None:
            qkv, conv_state = self.conv(qkv, pk, None if cache is None else cache.conv_state)
        else:
            qkv = F.silu(qkv)
        xp = pk.pack(x)
        # operator layout: dense (B, T, H, D), or packed (1, total, H, D) with cu_seqlens
        lead = (b, t) if packing is None else (1, qkv.shape[0])
        q, k, v = qkv.split((self.q_dim, self.k_dim, self.v_dim), -1)
        q, k, v = q.reshape(*lead, -1, self.head_k_dim), k.reshape(*lead, -1, self.head_k_dim), \
            v.reshape(*lead, self.num_v_heads, self.head_v_dim)
        state0 = None if cache is None or cache.empty else cache.state
        step = (state0 is not None and packing is None and t <= MAX_STEP_TOKENS and not torch.is_grad_enabled())
        o, state = self._mix(xp.reshape(*lead, -1), q, k, v, state0, cache is not None,
                             None if packing is None else packing.cu_seqlens, step)
        if step:   # decode: both states keep their addresses (a captured step replays on them)
            if conv_state is not None:
                cache.conv_state.copy_(conv_state)
        elif cache is not None:
            cache.conv_state, cache.state = conv_state, state
        gate = self.g_proj(xp).reshape(*o.shape)
        o = self.o_norm(o, gate).reshape(-1, self.v_dim)
        return pk.unpack(self.o_proj(o)).view(b, t, -1)


class KimiDeltaAttention(_RecurrentLayer):
    """The KDA layer of Kimi Linear on :func:`delta_attn.kda`.

    q/k/v projections -> short conv (kernel ``conv_size``) + SiLU -> q, k L2-normalised in the op
    (``use_qk_l2norm``) -> low-rank forget gate ``f_proj(x)`` turned into the log decay
    ``-exp(A_log) * softplus(f + dt_bias)`` inside the op -> ``beta = sigmoid(b_proj(x))`` ->
    KDA -> ``sigmoid(g_proj(x)) * RMSNorm(o)`` -> output projection. ``num_v_heads`` > ``num_heads``
    gives grouped value heads (GVA). State per sequence: (HV, K, V) float32.

    >>> import torch, delta_attn.nn as dnn
    >>> layer = dnn.KimiDeltaAttention(32, num_heads=2, backend="torch")
    >>> layer(torch.randn(2, 5, 32)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: Optional[int] = None,
                 num_v_heads: Optional[int] = None, head_v_dim: Optional[int] = None, conv_size: int = 4,
                 use_short_conv: bool = True, gate_low_rank_dim: Optional[int] = None, norm_eps: float = 1e-5,
                 use_qk_l2norm: bool = True, lower_bound: Optional[float] = None, backend: str = "auto",
                 layer_idx: Optional[int] = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads or num_heads
        if self.num_v_heads % num_heads:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_heads ({num_heads})")
        self.head_k_dim = head_dim or hidden_size // num_heads
        self.head_v_dim = head_v_dim or self.head_k_dim
        self.q_dim = self.k_dim = num_heads * self.head_k_dim
        self.v_dim = self.num_v_heads * self.head_v_dim
        self.use_qk_l2norm, self.lower_bound = use_qk_l2norm, lower_bound
        self.backend, self.layer_idx = backend, layer_idx
        rank = gate_low_rank_dim or self.head_v_dim
        self._build_common(hidden_size, conv_size, use_short_conv, rank, norm_eps)
        self.f_proj = _low_rank(hidden_size, rank, self.num_v_heads * self.head_k_dim, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads * self.head_k_dim))
        init_decay_params(self.A_log, self.dt_bias)

    def _mix(self, x, q, k, v, state0, want_state, cu_seqlens, step):
        g = self.f_proj(x).reshape(*q.shape[:2], self.num_v_heads, self.head_k_dim)
        beta = torch.sigmoid(self.b_proj(x))
        kw = dict(use_qk_l2norm=self.use_qk_l2norm, A_log=_fp32_param(self.A_log),
                  dt_bias=_fp32_param(self.dt_bias), lower_bound=self.lower_bound, backend=self.backend)
        if step:   # decode: the recurrent step updates the cached state in place
            return kda_step(q, k, v, g, beta, state0, **kw), state0
        return kda(q, k, v, g, beta, initial_state=state0, output_final_state=want_state,
                   cu_seqlens=cu_seqlens, **kw)


class GatedDiagonalAttention(_RecurrentLayer):
    """Gated diagonal linear attention layer on :func:`delta_attn.gated_diag_attn`.

    The KDA layer's shape with an element-wise state: q/k/v projections -> short conv + SiLU ->
    low-rank forget gate ``-exp(A_log) * softplus(f_proj(x) + dt_bias)`` (log decay, per channel) ->
    ``s_t = exp(g_t) * s_{t-1} + k_t * v_t``, ``o_t = q_t * s_t`` -> ``sigmoid(g_proj(x)) * RMSNorm(o)``
    -> output projection. State per sequence: (H, D) float32.

    >>> import torch, delta_attn.nn as dnn
    >>> layer = dnn.GatedDiagonalAttention(32, num_heads=2, backend="torch")
    >>> layer(torch.randn(2, 5, 32)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: Optional[int] = None, conv_size: int = 4,
                 use_short_conv: bool = True, gate_low_rank_dim: Optional[int] = None, norm_eps: float = 1e-5,
                 backend: str = "auto", layer_idx: Optional[int] = None):
        super().__init__()
        self.num_heads = self.num_v_heads = num_heads
        self.head_k_dim = self.head_v_dim = head_dim or hidden_size // num_heads
        self.q_dim = self.k_dim = self.v_dim = num_heads * self.head_k_dim
        self.backend, self.layer_idx = backend, layer_idx
        rank = gate_low_rank_dim or self.head_v_dim
        self._build_common(hidden_size, conv_size, use_short_conv, rank, norm_eps)
        self.f_proj = _low_rank(hidden_size, rank, self.v_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.v_dim))
        init_decay_params(self.A_log, self.dt_bias)

    def _mix(self, x, q, k, v, state0, want_state, cu_seqlens, step):
        f = self.f_proj(x).reshape(*q.shape) + self.dt_bias.view(self.num_heads, self.head_k_dim).to(x.dtype)
        g = -self.A_log.exp().to(x.dtype).view(self.num_heads, 1) * F.softplus(f)      # log decay <= 0
        if step:
            return gated_diag_step(q, k, v, g, state0, backend=self.backend), state0
        return gated_diag_attn(q, k, v, g, initial_state=state0, output_final_state=want_state,
                               cu_seqlens=cu_seqlens, backend=self.backend)
