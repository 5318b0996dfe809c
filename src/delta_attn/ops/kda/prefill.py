"""Fused inference prefill of KDA (Triton): one kernel walks a sequence's chunks with the state on chip.

A program owns one (sequence, value head, V block) chain and keeps its fp32 state block S (K x BV) in
registers from the first chunk to the last. Per chunk of BT tokens, nothing but the inputs and o touches HBM:

1. load q, k, g, beta (BT x K) and v (BT x BV); L2-normalise q and k; the gate and the floored log decays
   cumulated over the chunk's rows, G (``gate.py``);
2. the intra-chunk products ``Akk_ij = beta_i k_i . D_ij . k_j`` (i > j) and ``Aqk_ij = q_i . D_ij . k_j``
   (i >= j) with ``D_ij = diag(exp(G_i - G_j))``: factored as ``exp(G_i - G_m) exp(G_m - G_j)`` about the
   chunk's middle row m while every exponent is within ``FACTOR_MAX``, else pairwise per channel (exact,
   K slice by K slice: strongly decaying chunks only);
3. the UT transform ``T = (I + Akk)^-1`` (``intra._kda_tri_inverse_dots``);
4. against the state: ``u = T (beta (v - exp(G) k S))`` (the delta-rule correction),
   ``o = exp(G) q S + Aqk u`` and ``S <- exp(G_last) S + (exp(G_last - G) k)^T u``.

The dots take ``OP`` operands (bf16 for bf16 inputs: bf16 tensor-core products with fp32 accumulation) with
``PREC`` for fp32 operands, and ``INV_PREC`` for the fp32 UT transform.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gate import _kda_cumsum, _kda_floor, _kda_gdiff, _kda_load_decay, _kda_rel, _kda_row_at
from .intra import _kda_tri_inverse_dots


@triton.jit
def _kda_prefill_pairwise(q, k, g, dt_bias, a, lower_bound, q_off, g_off, hv, mr, rq, rk, i,
                          K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr,
                          HAS_DT_BIAS: tl.constexpr, FLOOR: tl.constexpr, TWO_FLOAT: tl.constexpr):
    """(Akk, Aqk) of one chunk from exact pairwise decays exp(G_i - G_j), i >= j (no exponent > 0),
    reloading q, k and g K slice by K slice (BT x BT x BK tiles)."""
    tril = (i[:, None] >= i[None, :])[:, :, None]
    akk = tl.zeros([BT, BT], tl.float32)
    aqk = tl.zeros([BT, BT], tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m = mr[:, None] & (cols[None, :] < K)
        qs = tl.load(q + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rq[:, None]
        ks = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
        x_, d = _kda_load_decay(g, dt_bias, a, lower_bound, g_off + cols[None, :], hv, cols, m, K, GATE,
                                HAS_DT_BIAS)
        G, Gl = _kda_cumsum(tl.where(m, _kda_floor(d, FLOOR), 0.0), FLOOR, TWO_FLOAT)
        Gij = _kda_gdiff(G[:, None, :], Gl[:, None, :], G[None, :, :], Gl[None, :, :], TWO_FLOAT)
        E = tl.exp(tl.where(tril, Gij, float("-inf")))
        akk += tl.sum(ks[:, None, :] * ks[None, :, :] * E, 2)
        aqk += tl.sum(qs[:, None, :] * ks[None, :, :] * E, 2)
    return akk, aqk


@triton.jit
def _kda_prefill_kernel(q, k, v, g, beta, A_log, dt_bias, h0, seq_info, O, HT,
                        scale, lower_bound, H, HV,
                        K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                        FLOOR: tl.constexpr, FACTOR_MAX: tl.constexpr, USE_H0: tl.constexpr,
                        STORE_FINAL: tl.constexpr, OP: tl.constexpr, PREC: tl.constexpr, INV_PREC: tl.constexpr,
                        TWO_FLOAT: tl.constexpr):
    iv = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    hv = tl.program_id(2).to(tl.int64)
    h = hv // (HV // H)
    row0 = tl.load(seq_info + n * 3).to(tl.int64)
    Tn = tl.load(seq_info + n * 3 + 1)
    kk = tl.arange(0, KP)
    vv = iv * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    i = tl.arange(0, BT)
    s_off = kk[:, None] * V + vv[None, :]
    st = (n * HV + hv) * K * V
    a = 1.0
    if GATE != 0:
        a = tl.exp(tl.load(A_log + hv).to(tl.float32))
    S = tl.zeros([KP, BV], tl.float32)
    if USE_H0:
        S += tl.load(h0 + st + s_off, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
    for t0 in range(0, Tn, BT):
        # 1. the chunk's rows, inputs, row norms and cumulative log decays
        L = tl.minimum(Tn - t0, BT)
        mr = i < L
        rows = row0 + t0 + i
        q_off = (rows * H + h)[:, None] * K
        g_off = (rows * HV + hv)[:, None] * K
        v_off = (rows * HV + hv)[:, None] * V + vv[None, :]
        mq = mr[:, None] & mk[None, :]
        qx = tl.load(q + q_off + kk[None, :], mask=mq, other=0.0).to(tl.float32)
        kx = tl.load(k + q_off + kk[None, :], mask=mq, other=0.0).to(tl.float32)
        vs = tl.load(v + v_off, mask=mr[:, None] & mv[None, :], other=0.0).to(tl.float32)
        b = tl.load(beta + rows * HV + hv, mask=mr, other=0.0).to(tl.float32)
        x_, d = _kda_load_decay(g, dt_bias, a, lower_bound, g_off + kk[None, :], hv, kk, mq, K, GATE, HAS_DT_BIAS)
        G, Gl = _kda_cumsum(tl.where(mq, _kda_floor(d, FLOOR), 0.0), FLOOR, TWO_FLOAT)
        if L2NORM:
            rq = scale / tl.sqrt(tl.sum(qx * qx, 1) + 1e-6)
            rk = 1.0 / tl.sqrt(tl.sum(kx * kx, 1) + 1e-6)
        else:
            rq = tl.full([BT], 1.0, tl.float32) * scale
            rk = tl.full([BT], 1.0, tl.float32)
        qs = qx * rq[:, None]
        ks = kx * rk[:, None]
        # 2. intra-chunk products, factored about the middle row, or pairwise where that would overflow
        Gm = _kda_rel(G, Gl, i, BT // 2 - 1, TWO_FLOAT)
        if tl.max(tl.max(tl.abs(Gm), 1), 0) <= FACTOR_MAX:
            eP = tl.exp(Gm)
            kn = (ks * tl.exp(-Gm)).to(OP)
            akk = tl.dot((ks * eP).to(OP), tl.trans(kn), input_precision=PREC)
            aqk = tl.dot((qs * eP).to(OP), tl.trans(kn), input_precision=PREC)
        else:
            akk, aqk = _kda_prefill_pairwise(q, k, g, dt_bias, a, lower_bound, q_off, g_off, hv, mr, rq, rk, i,
                                             K, BT, BK, GATE, HAS_DT_BIAS, FLOOR, TWO_FLOAT)
        # 3. UT transform
        akk = tl.where(i[:, None] > i[None, :], b[:, None] * akk, 0.0)
        aqk = tl.where(i[:, None] >= i[None, :], aqk, 0.0)
        T = _kda_tri_inverse_dots(akk, BT, INV_PREC)
        # 4. against the state: u, o, and the state carried to the next chunk
        eG = tl.exp(G)
        kd = ks * tl.exp(-_kda_rel(G, Gl, i, L - 1, TWO_FLOAT))
        gc = tl.exp(_kda_row_at(G, i, L - 1))
        Sd = S.to(OP)
        ks_S = tl.dot((ks * eG).to(OP), Sd, input_precision=PREC)
        u = tl.dot(T, b[:, None] * (vs - ks_S), input_precision=INV_PREC).to(OP)
        o = tl.dot((qs * eG).to(OP), Sd, input_precision=PREC)
        o += tl.dot(aqk.to(OP), u, input_precision=PREC)
        tl.store(O + v_off, o.to(O.dtype.element_ty), mask=mr[:, None] & mv[None, :])
        S = S * gc[:, None] + tl.dot(tl.trans(kd.to(OP)), u, input_precision=PREC)
    if STORE_FINAL:
        tl.store(HT + st + s_off, S, mask=mk[:, None] & mv[None, :])
