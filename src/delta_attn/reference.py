"""The specification of every delta-attn operator, in plain PyTorch.

These functions define what the kernels must compute (docs/CONTRACT.md, "Semantics"). They are written
for clarity, not speed, run on any device and in any floating dtype (float64 included), and
support autograd, so they also serve as the ``backend="torch"`` path.

Precision: with ``upcast=True`` (default) half-precision inputs are computed in float32 and float64
inputs in float64; the output is cast back to the input dtype. With ``upcast=False`` the arithmetic
runs in the input dtype, which is what the error rule of the tests compares against ("the same
computation done in PyTorch in the kernel's precision").

Shapes (B batch, T/Sq/Sk tokens, H heads, D/K/V head dims, N states):
  attention            q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) -> (B, Sq, Hq, Dv),
                       lse (B, Hq, Sq)
  attention_varlen     q (total_q, Hq, D) ("thd") or (Hq, total_q, D) ("htd") -> same layout,
                       lse (Hq, total_q)
  attention_with_kvcache  q (B, Sq, Hq, D), caches (B_cache, S_cache, Hk, D) or paged
                       (num_blocks, page_size, Hk, D) -> (B, Sq, Hq, D), lse (B, Hq, Sq)
  kda                  q, k (B, T, H, K), v (B, T, HV, V), g (B, T, HV, K), beta (B, T, HV),
                       states (N, HV, K, V)
  gated_diag           q, k, v, g (B, T, H, D), states (N, H, D)
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

# the log-depth scan of gated_diag with closed-form gradients, for long sequences (tests; not in __all__)
from ._reference_diag import gated_diag_scan  # noqa: F401

__all__ = [
    "attention",
    "attention_varlen",
    "attention_mask",
    "attention_with_kvcache",
    "rotary",
    "kda",
    "kda_gate",
    "l2norm",
    "gated_diag",
    "L2NORM_EPS",
]

L2NORM_EPS = 1e-6


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision rule, written once: what a computation on ``dtype`` inputs accumulates in and returns its
    statistics and states in (lse, recurrent states, merges of partial results): float64 for float64 inputs,
    float32 for every other floating dtype (fp16 / bf16 / fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# what accumulation_dtype returns: the dtypes a state (initial state, decode state pool) or a gate parameter
# (A_log, dt_bias) is accepted in
ACCUMULATION_DTYPES = (torch.float32, torch.float64)


def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    return accumulation_dtype(dtype) if upcast else dtype


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------

def attention_mask(sq: int, sk: int, window_size: Tuple[int, int] = (-1, -1), causal: bool = False,
                   device=None) -> torch.Tensor:
    """Boolean (Sq, Sk) mask of the keys each query may see.

    Query i sees key j when ``i + Sk - Sq - wl <= j <= i + Sk - Sq + wr``; a negative bound is
    unbounded and ``causal`` sets ``wr = 0`` (bottom-right aligned, as flash-attn >= 2.1).
    """
    wl, wr = window_size
    if causal:
        wr = 0
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    diag = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if wl >= 0:
        visible &= j >= diag - wl
    if wr >= 0:
        visible &= j <= diag + wr
    return visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: Optional[float] = None,
              causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
              alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              dropout_mask: Optional[torch.Tensor] = None, upcast: bool = True
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense attention. Returns ``(out (B, Sq, Hq, Dv), lse (B, Hq, Sq))``.

    ``dropout_mask`` (B, Hq, Sq, Sk) bool marks the kept probabilities; kept ones are scaled by
    ``1 / (1 - dropout_p)``. The LSE is that of the scores before dropout. A query row that sees no
    key gets a zero output and ``lse = +inf`` (flash-attn's convention, so ``exp(s - lse) = 0``).
    """
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dt = _compute_dtype(q.dtype, upcast)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    # GQA: query head h reads key/value head h // (Hq / Hk)
    group = hq // hk
    qf = q.to(dt).transpose(1, 2)                                   # (B, Hq, Sq, D)
    kf = k.to(dt).transpose(1, 2).repeat_interleave(group, dim=1)   # (B, Hq, Sk, D)
    vf = v.to(dt).transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dt)
        slopes = slopes.view(1, hq, 1, 1) if slopes.dim() == 1 else slopes.view(b, hq, 1, 1)
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s - slopes * (i + sk - sq - j).abs().to(dt)
    visible = attention_mask(sq, sk, window_size, causal, device=q.device)
    s = s.masked_fill(~visible, float("-inf"))
    row_visible = visible.any(dim=-1)                                # (Sq,)
    # empty rows get finite scores so that neither the softmax nor its gradient sees -inf - -inf
    s = torch.where(row_visible[:, None], s, torch.zeros_like(s))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    p = torch.where(row_visible[:, None], p, torch.zeros_like(p))
    lse = torch.where(row_visible, lse, torch.full_like(lse, float("inf")))
    if dropout_p > 0.0:
        if dropout_mask is None:
            raise ValueError("reference.attention: dropout_p > 0 needs the dropout_mask it applies")
        p = p * dropout_mask.to(dt) / (1.0 - dropout_p)
    out = torch.matmul(p, vf).transpose(1, 2)
    return out.to(q.dtype), lse.to(accumulation_dtype(dt))


def _seq_slices(cu_seqlens: torch.Tensor):
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, *, softmax_scale: Optional[float] = None,
                     causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                     softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                     dropout_p: float = 0.0, dropout_masks: Optional[Sequence[torch.Tensor]] = None,
                     layout: str = "thd", upcast: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed variable-length attention: each sequence is an independent dense call.

    ``layout="thd"``: tensors (total, H, D); ``"htd"``: (H, total, D). Returns ``(out, lse)`` with
    out in the layout of q and lse (Hq, total_q). ``dropout_masks[i]`` is sequence i's keep-mask
    (1, Hq, Sq_i, Sk_i). ``alibi_slopes`` (B, Hq) is indexed by sequence.
    """
    if layout == "htd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    hq, dv = q.shape[1], v.shape[2]
    lse_dtype = accumulation_dtype(_compute_dtype(q.dtype, upcast))
    outs, lses = [], []
    for i, ((q0, q1), (k0, k1)) in enumerate(zip(_seq_slices(cu_seqlens_q), _seq_slices(cu_seqlens_k))):
        if k1 == k0:   # no key at all: zero output, lse = +inf
            outs.append(q.new_zeros(q1 - q0, hq, dv, dtype=v.dtype))
            lses.append(torch.full((hq, q1 - q0), float("inf"), dtype=lse_dtype, device=q.device))
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
        o_i, l_i = attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale=softmax_scale,
                             causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=slopes,
                             dropout_p=dropout_p,
                             dropout_mask=None if dropout_masks is None else dropout_masks[i],
                             upcast=upcast)
        outs.append(o_i[0])
        lses.append(l_i[0].to(lse_dtype))
    out = torch.cat(outs, 0) if outs else q.new_zeros(0, hq, dv, dtype=v.dtype)
    lse = torch.cat(lses, 1) if lses else torch.zeros(hq, 0, dtype=lse_dtype, device=q.device)
    if layout == "htd":
        out = out.transpose(0, 1)
    return out, lse


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool = True) -> torch.Tensor:
    """Rotary embedding of ``x`` (S, H, D) at ``positions`` (S,) with tables ``cos`` / ``sin``
    (seqlen_ro, R / 2): the first R channels rotate, the others pass through. ``interleaved`` pairs
    channels (2i, 2i + 1); otherwise (i, i + R / 2) (GPT-NeoX). Pair (a, b) at angle t becomes
    ``(a cos t - b sin t, a sin t + b cos t)``. Computed in the dtype of ``x``."""
    r = 2 * cos.shape[-1]
    c = cos[positions].to(x.dtype).unsqueeze(-2)            # (S, 1, R/2)
    s = sin[positions].to(x.dtype).unsqueeze(-2)
    xr, rest = x[..., :r], x[..., r:]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)
    else:
        a, b = xr[..., :r // 2], xr[..., r // 2:]
        rotated = torch.cat([a * c - b * s, a * s + b * c], -1)
    return torch.cat([rotated, rest], -1)


def _cache_slots(b: int, positions: torch.Tensor, cache_batch_idx, block_table, page: int):
    """Where logical cache positions of batch row ``b`` live: (cache row or block, offset) index tensors."""
    if block_table is not None:
        return block_table[b].long()[positions // page], positions % page
    row = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return torch.full_like(positions, row), positions


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *,
                           cache_seqlens=None, rotary_cos: Optional[torch.Tensor] = None,
                           rotary_sin: Optional[torch.Tensor] = None,
                           cache_batch_idx: Optional[torch.Tensor] = None,
                           cache_leftpad: Optional[torch.Tensor] = None,
                           block_table: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                           causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           rotary_interleaved: bool = True, alibi_slopes: Optional[torch.Tensor] = None,
                           upcast: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a KV cache (flash-attn 2's ``flash_attn_with_kvcache``). Returns
    ``(out (B, Sq, Hq, D), lse (B, Hq, Sq))`` and writes ``k`` / ``v`` into the caches in place.

    Per batch row b, with ``n = cache_seqlens[b]`` tokens already cached (an int for every row; None:
    the whole cache), ``Snew = k.shape[1]`` and ``lp = cache_leftpad[b]`` (0 if None):
      1. rotary (``rotary_cos`` / ``rotary_sin``): new key t is rotated at position ``n + t``; query i at
         ``n + i`` when ``causal`` or a window is set, else every query at ``n``;
      2. the (rotated) new keys and values are written at cache positions ``n .. n + Snew - 1`` of cache
         row ``cache_batch_idx[b]`` (b if None), or of the pages ``block_table[b]`` names (position p is
         slot ``p % page_size`` of block ``block_table[b, p // page_size]``);
      3. the queries attend to cache positions ``lp .. n + Snew - 1`` as one dense
         :func:`attention` call (Sk = n + Snew - lp: causal and windows aligned bottom-right).
    """
    b, sq = q.shape[0], q.shape[1]
    paged = block_table is not None
    page = k_cache.shape[1]
    capacity = block_table.shape[1] * page if paged else k_cache.shape[1]
    snew = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        seqlens = [capacity] * b
    elif isinstance(cache_seqlens, int):
        seqlens = [cache_seqlens] * b
    else:
        seqlens = [int(x) for x in cache_seqlens.tolist()]
    leftpad = [0] * b if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    dt = _compute_dtype(q.dtype, upcast)
    per_query = causal or tuple(window_size) != (-1, -1)
    outs, lses = [], []
    for bi in range(b):
        n, lp = seqlens[bi], leftpad[bi]
        qb = q[bi]
        # 1-2. rotary, then the new keys and values into the cache
        if k is not None:
            pos = torch.arange(n, n + snew, device=q.device)
            kb = k[bi]
            if rotary_cos is not None:
                kb = rotary(kb.to(dt), rotary_cos, rotary_sin, pos, rotary_interleaved)
            rows, offs = _cache_slots(bi, pos, cache_batch_idx, block_table, page)
            k_cache[rows, offs] = kb.to(k_cache.dtype)
            v_cache[rows, offs] = v[bi].to(v_cache.dtype)
        if rotary_cos is not None:
            qpos = torch.arange(n, n + sq, device=q.device) if per_query else torch.full((sq,), n, device=q.device)
            qb = rotary(qb.to(dt), rotary_cos, rotary_sin, qpos, rotary_interleaved).to(q.dtype)
        # 3. attend to positions lp .. n + Snew - 1
        rows, offs = _cache_slots(bi, torch.arange(lp, n + snew, device=q.device), cache_batch_idx, block_table, page)
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[bi])
        o, lse = attention(qb[None], k_cache[rows, offs][None], v_cache[rows, offs][None],
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                           alibi_slopes=slopes, upcast=upcast)
        outs.append(o)
        lses.append(lse)
    if b == 0:
        return q.new_empty(q.shape), torch.empty(0, q.shape[2], sq, dtype=torch.float32, device=q.device)
    return torch.cat(outs, 0), torch.cat(lses, 0)


# ----------------------------------------------------------------------------------------------
# Kimi Delta Attention
# ----------------------------------------------------------------------------------------------

def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the q/k normalisation of KDA)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: Optional[torch.Tensor] = None,
             lower_bound: Optional[float] = None) -> torch.Tensor:
    """The in-kernel KDA gate: raw gate input g (B, T, HV, K) -> log decay.

    ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``. A_log (HV,), dt_bias (HV*K,).
    """
    hv, kdim = g.shape[-2], g.shape[-1]
    x = g if dt_bias is None else g + dt_bias.to(g.dtype).view(hv, kdim)
    a = A_log.to(g.dtype).exp().view(hv, 1)
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def _prepare_kda(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias, lower_bound, upcast):
    dt = _compute_dtype(q.dtype, upcast)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if A_log is not None:
        g = kda_gate(g, A_log.to(dt), None if dt_bias is None else dt_bias.to(dt), lower_bound)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # GVA: value head hv reads query/key head hv // (HV / H)
    group = v.shape[2] // q.shape[2]
    q = q.repeat_interleave(group, dim=2) * scale
    k = k.repeat_interleave(group, dim=2)
    return q, k, v, g, beta, dt


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
        scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
        output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
        use_qk_l2norm: bool = False, A_log: Optional[torch.Tensor] = None,
        dt_bias: Optional[torch.Tensor] = None, lower_bound: Optional[float] = None,
        upcast: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi Delta Attention, token by token. Returns ``(o (B, T, HV, V), final_state or None)``.

    Per sequence and value head, from S = initial_state (or 0), for each t:
      S <- Diag(exp(g_t)) S                        (channel-wise decay of the K rows)
      S <- S + beta_t k_t (v_t - S^T k_t)^T        (delta rule)
      o_t = S^T (scale * q_t)
    The final state is float32 (float64 for float64 inputs).
    """
    qs, ks, vs, gs, bs, dt = _prepare_kda(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias,
                                          lower_bound, upcast)
    b, t, hv, vdim = v.shape
    zero = qs.new_zeros(hv, q.shape[-1], vdim)

    def scan(n, sl, bi):
        """One sequence (or, dense, the whole batch at once): the recurrence token by token."""
        S = (zero if initial_state is None else initial_state[n].to(dt)).expand(len(bi), -1, -1, -1)
        outs = []
        for ti in range(sl.start, sl.stop):
            S = S * gs[bi, ti].exp().unsqueeze(-1)                               # decay the K rows
            kt, bt = ks[bi, ti], bs[bi, ti].unsqueeze(-1)
            pred = torch.einsum("bhkv,bhk->bhv", S, kt)                          # S^T k
            S = S + torch.einsum("bhk,bhv->bhkv", kt, bt * (vs[bi, ti] - pred))  # delta rule
            outs.append(torch.einsum("bhkv,bhk->bhv", S, qs[bi, ti]))            # S^T (scale q)
        return outs, S

    o, final = _run_sequences(scan, b, t, cu_seqlens, vs.new_zeros(b, 0, hv, vdim))
    return o.to(v.dtype), (final.to(accumulation_dtype(dt)) if output_final_state else None)


def _run_sequences(scan, b: int, t: int, cu_seqlens: Optional[torch.Tensor], empty: torch.Tensor):
    """Run ``scan(n, time slice, batch index) -> (per-token outputs, final states)`` over every
    sequence: the whole dense batch at once, or each packed sequence of ``cu_seqlens`` in turn.
    Returns o (B, T, ...) and the final states (N, ...)."""
    if cu_seqlens is None:
        outs, final = scan(slice(None), slice(0, t), torch.arange(b))
        return (torch.stack(outs, 1) if outs else empty), final
    outs, finals = [], []
    for n, (t0, t1) in enumerate(_seq_slices(cu_seqlens)):
        o_n, f_n = scan(n, slice(t0, t1), torch.zeros(1, dtype=torch.long))
        outs += o_n
        finals.append(f_n[0])
    return (torch.stack(outs, 1) if outs else empty), torch.stack(finals, 0)


# ----------------------------------------------------------------------------------------------
# gated diagonal attention
# ----------------------------------------------------------------------------------------------

def gated_diag(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
               initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
               cu_seqlens: Optional[torch.Tensor] = None, upcast: bool = True
               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated diagonal (element-wise) linear attention. Returns ``(o (B, T, H, D), final_state)``.

    Per sequence, channel by channel: ``s_t = exp(g_t) * s_{t-1} + k_t * v_t``, ``o_t = q_t * s_t``.
    Non-finite values follow from the formula within their own sequence only: a NaN gate makes the state
    NaN from its token on (no clamp; ``exp(NaN) * 0`` at a first token is NaN), and each sequence starts
    from its own initial state (or 0), never from the previous sequence's.
    """
    dt = _compute_dtype(q.dtype, upcast)
    b, t, h, d = q.shape
    qf, kf, vf, gf = (x.to(dt) for x in (q, k, v, g))
    zero = qf.new_zeros(h, d)

    def scan(n, sl, bi):
        s = (zero if initial_state is None else initial_state[n].to(dt)).expand(len(bi), -1, -1)
        outs = []
        for ti in range(sl.start, sl.stop):
            s = gf[bi, ti].exp() * s + kf[bi, ti] * vf[bi, ti]
            outs.append(qf[bi, ti] * s)
        return outs, s

    o, final = _run_sequences(scan, b, t, cu_seqlens, qf.new_zeros(b, 0, h, d))
    return o.to(q.dtype), (final.to(accumulation_dtype(dt)) if output_final_state else None)
