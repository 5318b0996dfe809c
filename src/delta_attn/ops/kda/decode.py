"""Decode stage of KDA (Triton): a few new tokens per sequence from a state pool, updated in place.

One program per (V block, sequence, value head): the fp32 state block S (K x BV) is read once from
``state[state_indices[b]]``, advanced token by token (decay ``S <- exp(g) S``; correction
``u = beta (v - S^T k)``; write ``S <- S + k u^T``; read-out ``o = S^T (scale q)``) and written back.
Plain fp32 FMA arithmetic: fp32-accurate for every input dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gate import _kda_gate


@triton.jit
def _kda_step_kernel(q, k, v, g, beta, A_log, dt_bias, S, idx, O,
                     scale, lower_bound, T, H, HV,
                     K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
                     L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                     HAS_IDX: tl.constexpr):
    iv = tl.program_id(0)
    bi = tl.program_id(1).to(tl.int64)
    hv = tl.program_id(2).to(tl.int64)
    h = hv // (HV // H)
    slot = bi
    if HAS_IDX:
        slot = tl.load(idx + bi).to(tl.int64)
    kk = tl.arange(0, KP)
    vv = iv * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    ms = mk[:, None] & mv[None, :]
    s_ptr = S + (slot * HV + hv) * K * V + kk[:, None] * V + vv[None, :]
    st = tl.load(s_ptr, mask=ms, other=0.0).to(tl.float32)
    a = 1.0
    if GATE != 0:
        a = tl.exp(tl.load(A_log + hv).to(tl.float32))
    bias = tl.zeros([KP], tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + hv * K + kk, mask=mk, other=0.0).to(tl.float32)
    for t in range(0, T):
        row = bi * T + t
        qv = tl.load(q + (row * H + h) * K + kk, mask=mk, other=0.0).to(tl.float32)
        kv = tl.load(k + (row * H + h) * K + kk, mask=mk, other=0.0).to(tl.float32)
        if L2NORM:
            qv = qv / tl.sqrt(tl.sum(qv * qv, 0) + 1e-6)
            kv = kv / tl.sqrt(tl.sum(kv * kv, 0) + 1e-6)
        x = tl.load(g + (row * HV + hv) * K + kk, mask=mk, other=0.0).to(tl.float32) + bias
        d = _kda_gate(x, a, lower_bound, GATE)
        b = tl.load(beta + row * HV + hv).to(tl.float32)
        vt = tl.load(v + (row * HV + hv) * V + vv, mask=mv, other=0.0).to(tl.float32)
        # decay, delta-rule correction, read-out
        st = st * tl.exp(d)[:, None]
        u = b * (vt - tl.sum(st * kv[:, None], 0))
        st += kv[:, None] * u[None, :]
        o = tl.sum(st * (qv * scale)[:, None], 0)
        tl.store(O + (row * HV + hv) * V + vv, o.to(O.dtype.element_ty), mask=mv)
    tl.store(s_ptr, st.to(S.dtype.element_ty), mask=ms)
