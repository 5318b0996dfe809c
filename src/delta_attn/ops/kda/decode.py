"""Decode stage of KDA (Triton): a few new tokens per sequence from a state pool, updated in place.

One program per (V block, sequence, value head): the fp32 state block S (K x BV) is read once from its
start slot (``ops/_slots.py``: ``state_indices`` (B,) or, speculative, (B, T) with ``num_accepted_tokens``)
and kept in registers while the program walks the T tokens; per token:
  1. decay ``S <- exp(g) S``;
  2. both reductions over K from the decayed S, in one pass: ``p = S^T k`` and ``r = S^T (scale q)``;
  3. correction ``u = beta (v - p)`` and read-out ``o = r + (k . scale q) u`` (= ``(S + k u^T)^T scale q``,
     so the read-out needs no second pass over the updated S);
  4. write ``S <- S + k u^T``, stored to the token's slot with (B, T) indices.
Without (B, T) indices S is stored once, to the start slot, after the last token. Plain fp32 FMA
arithmetic: fp32-accurate for every input dtype. ``EVEN`` (K == KP and V % BV == 0) drops the masks.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._slots import _start_slot, _token_slot
from ..diag.kernels import _ld, _st
from .gate import _kda_gate


@triton.jit
def _kda_step_token(q, k, v, g, beta, S, idx, O, st, a, bias, bi, hv, h, t, kk, mk, vv, mv, ms, in_slot,
                    scale, lower_bound, T, H, HV, K: tl.constexpr, V: tl.constexpr, L2NORM: tl.constexpr,
                    GATE: tl.constexpr, IDX: tl.constexpr, EVEN: tl.constexpr):
    """Token t of sequence bi on the state block ``st`` (fp32, K x BV columns ``vv`` of value head hv): stores
    its output (and, with (B, T) slots, the state after it); returns the updated block."""
    row = bi * T + t
    # 0. the token's inputs, all issued before any arithmetic waits on one of them
    qv = tl.load(q + (row * H + h) * K + kk, mask=mk, other=0.0).to(tl.float32)
    kv = tl.load(k + (row * H + h) * K + kk, mask=mk, other=0.0).to(tl.float32)
    x = tl.load(g + (row * HV + hv) * K + kk, mask=mk, other=0.0).to(tl.float32) + bias
    b = tl.load(beta + row * HV + hv).to(tl.float32)
    vt = _ld(v + (row * HV + hv) * V + vv, mv, EVEN).to(tl.float32)
    if L2NORM:
        qv = qv / tl.sqrt(tl.sum(qv * qv, 0) + 1e-6)
        kv = kv / tl.sqrt(tl.sum(kv * kv, 0) + 1e-6)
    qv = qv * scale
    d = _kda_gate(x, a, lower_bound, GATE)
    # 1. decay; 2. both reductions over K; 3. correction and read-out; 4. delta-rule write
    st = st * tl.exp(d)[:, None]
    p = tl.sum(st * kv[:, None], 0)
    r = tl.sum(st * qv[:, None], 0)
    u = b * (vt - p)
    o = r + tl.sum(kv * qv, 0) * u
    st = st + kv[:, None] * u[None, :]
    _st(O + (row * HV + hv) * V + vv, o.to(O.dtype.element_ty), mv, EVEN)
    if IDX == 2:
        _st(S + _token_slot(idx, bi, T, t) * (HV * K * V) + in_slot, st.to(S.dtype.element_ty), ms, EVEN)
    return st


@triton.jit
def _kda_step_kernel(q, k, v, g, beta, A_log, dt_bias, S, idx, nat, O,
                     scale, lower_bound, T, H, HV,
                     K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
                     L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                     IDX: tl.constexpr, HAS_NAT: tl.constexpr, EVEN: tl.constexpr):
    iv = tl.program_id(0)
    bi = tl.program_id(1).to(tl.int64)
    hv = tl.program_id(2).to(tl.int64)
    h = hv // (HV // H)
    kk = tl.arange(0, KP)
    vv = iv * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    ms = mk[:, None] & mv[None, :]
    in_slot = (hv * K + kk[:, None]) * V + vv[None, :]         # the block's offsets inside one slot
    slot_size = HV * K * V
    s_start = S + _start_slot(idx, nat, bi, T, IDX, HAS_NAT) * slot_size + in_slot
    st = _ld(s_start, ms, EVEN).to(tl.float32)
    a = 1.0
    if GATE != 0:
        a = tl.exp(tl.load(A_log + hv).to(tl.float32))
    bias = tl.zeros([KP], tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + hv * K + kk, mask=mk, other=0.0).to(tl.float32)
    for t in range(0, T):
        st = _kda_step_token(q, k, v, g, beta, S, idx, O, st, a, bias, bi, hv, h, t, kk, mk, vv, mv, ms, in_slot,
                             scale, lower_bound, T, H, HV, K, V, L2NORM, GATE, IDX, EVEN)
    if IDX != 2:
        _st(s_start, st.to(S.dtype.element_ty), ms, EVEN)
