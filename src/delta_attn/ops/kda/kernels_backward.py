"""Backward stage of KDA training (Triton), on the 64-token chunks of the training forward.

1. ``_kda_bwd_scan_kernel`` (reverse over chunks, parallel over sequences x value heads x V blocks): the
   fp32 state gradient dS, ``du = Aqk^T dO + kd dS``, ``dS <- exp(G_last) dS + qg^T dO - W^T du``; stores du
   and every chunk-end dS.
2. ``_kda_bwd_chunk_grads_kernel`` (parallel over chunks x value heads x K blocks, full V): the gradients of
   the scan's operands from the chunk-start states S and dS: ``dqg = dO S^T``, ``dkd = u dS^T``,
   ``dW = -du S^T``, ``dAqk = dO u^T``, ``d exp(G_last) = sum_v S dS`` (where the factored launch of 3. is the Gluon
   kernel, ``kernels_backward_gluon``, it forms them itself and this launch is skipped).
3. ``_kda_bwd_intra_kernel`` (parallel over chunks x value heads): back through the UT transform, the decayed
   intra-chunk products (factored, or exact for strong decays: a second launch redoes the flagged chunks),
   the cumulative decays, the floor, the gate and the l2 norm; dq, dk to DQO / DKO in their dtype (through the
   fp32 scratch DQ / DK with the l2 norm).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels_scan import _scan_program, _scan_rows
from .kernels_gate import (_kda_chunk_decay, _kda_chunk_rows, _kda_cumsum, _kda_gate_grads, _kda_gdiff,
                           _kda_head_gate, _kda_l2norm_bwd_rows, _kda_rel, _kda_round_tf32, _kda_row_at,
                           _kda_row_norms_sliced, _kda_tangent, _kda_tangent_sum)


@triton.jit
def _kd_dot(kd, x, PREC: tl.constexpr):
    """kd x with x in the work dtype: a float32 kd (training with the Triton scans, ``launch.kd_dtype``) as the sum
    of its work-dtype rounding and the rounding's remainder, two products on the same tensor-core path."""
    hi = kd.to(x.dtype)
    out = tl.dot(hi, x, input_precision=PREC)
    if kd.dtype == tl.float32 and x.dtype != tl.float32:
        out += tl.dot((kd - hi.to(tl.float32)).to(x.dtype), x, input_precision=PREC)
    return out


@triton.jit
def _kda_bwd_scan_kernel(W, QG, KD, AQK, GC, DO, dht, seq_info, DU, DH0, DH, HV, NCMAX,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr,
                         BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
                         SPLIT: tl.constexpr):
    """Reverse scan: du and the chunk-end state gradients dS (stored for ``_kda_bwd_chunk_grads_kernel``);
    ``SPLIT`` = 2 walks each chunk as two row halves (half the tile memory, as the forward scan)."""
    hv, row0, Tn, cbase, kk, vv, mk, mv, s_off, ms, st = _scan_program(seq_info, HV, K, V, KP, BV)
    i = tl.arange(0, BT)
    dt = W.dtype.element_ty
    dS = tl.zeros([KP, BV], tl.float32)
    if USE_DHT:
        dS += tl.load(dht + st + s_off, mask=ms, other=0.0).to(tl.float32)
    nc = tl.cdiv(Tn, BT)
    for cc in range(0, NCMAX):
        c = NCMAX - 1 - cc
        live = c < nc
        gc = tl.load(GC + ((cbase + c) * HV + hv) * K + kk, mask=mk & live, other=1.0)
        dSd = dS.to(dt)
        tl.store(DH + ((cbase + c) * HV + hv) * K * V + s_off, dSd, mask=ms & live)
        # du = Aqk^T dO + kd dS_end ; dS_start = exp(G_last) dS_end + qg^T dO - W^T du
        if SPLIT == 1:
            rows, mr, k_off, v_off, mrk, mrv = _scan_rows(row0, Tn, c * BT, hv, HV, BT, K, V, kk, vv, mk, mv)
            A = tl.load(AQK + (rows * HV + hv)[:, None] * BT + i[None, :], mask=mr[:, None], other=0.0).to(dt)
            do = tl.load(DO + v_off, mask=mrv, other=0.0).to(dt)
            du = tl.dot(tl.trans(A), do, input_precision=PREC)
            du += _kd_dot(tl.load(KD + k_off, mask=mrk, other=0.0), dSd, PREC)
            tl.store(DU + v_off, du, mask=mrv)
            dS = dS * gc[:, None] + tl.dot(tl.trans(tl.load(QG + k_off, mask=mrk, other=0.0)), do,
                                           input_precision=PREC)
            dS -= tl.dot(tl.trans(tl.load(W + k_off, mask=mrk, other=0.0)), du.to(dt), input_precision=PREC)
        else:
            BR: tl.constexpr = BT // 2
            j = tl.arange(0, BR)
            ra, ma, ka, va, mka, mva = _scan_rows(row0, Tn, c * BT, hv, HV, BR, K, V, kk, vv, mk, mv)
            rb, mb, kb, vb, mkb, mvb = _scan_rows(row0, Tn, c * BT + BR, hv, HV, BR, K, V, kk, vv, mk, mv)
            do_a = tl.load(DO + va, mask=mva, other=0.0).to(dt)
            do_b = tl.load(DO + vb, mask=mvb, other=0.0).to(dt)
            a_bb = tl.load(AQK + (rb * HV + hv)[:, None] * BT + BR + j[None, :], mask=mb[:, None], other=0.0).to(dt)
            dub = tl.dot(tl.trans(a_bb), do_b, input_precision=PREC)
            dub += _kd_dot(tl.load(KD + kb, mask=mkb, other=0.0), dSd, PREC)
            a_aa = tl.load(AQK + (ra * HV + hv)[:, None] * BT + j[None, :], mask=ma[:, None], other=0.0).to(dt)
            a_ba = tl.load(AQK + (rb * HV + hv)[:, None] * BT + j[None, :], mask=mb[:, None], other=0.0).to(dt)
            dua = tl.dot(tl.trans(a_aa), do_a, input_precision=PREC) + tl.dot(tl.trans(a_ba), do_b,
                                                                             input_precision=PREC)
            dua += _kd_dot(tl.load(KD + ka, mask=mka, other=0.0), dSd, PREC)
            tl.store(DU + va, dua, mask=mva)
            tl.store(DU + vb, dub, mask=mvb)
            dS = dS * gc[:, None] + tl.dot(tl.trans(tl.load(QG + ka, mask=mka, other=0.0)), do_a,
                                           input_precision=PREC)
            dS += tl.dot(tl.trans(tl.load(QG + kb, mask=mkb, other=0.0)), do_b, input_precision=PREC)
            dS -= tl.dot(tl.trans(tl.load(W + ka, mask=mka, other=0.0)), dua.to(dt), input_precision=PREC)
            dS -= tl.dot(tl.trans(tl.load(W + kb, mask=mkb, other=0.0)), dub.to(dt), input_precision=PREC)
    if STORE_DH0:
        tl.store(DH0 + st + s_off, dS, mask=ms)


@triton.jit
def _kda_bwd_chunk_grads_kernel(HS, DH, VNEW, DO, DU, chunk_info, DQG, DKD, DW, DAQK, DGC, HV,
                                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKB: tl.constexpr,
                                BV: tl.constexpr, PREC: tl.constexpr):
    """Per chunk, value head and K block (parallel), over the full V: the gradients of the scan's
    operands from the chunk-start state S and the chunk-end state gradient dS (stored by the reverse
    scan): dqg = dO S^T, dkd = u dS^T, dW = -du S^T, dAqk = dO u^T (K block 0), d exp(G_last) = sum_v S dS."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    kb = tl.program_id(2)
    row0 = tl.load(chunk_info + c * 3 + 1).to(tl.int64)
    L = tl.load(chunk_info + c * 3 + 2)
    i = tl.arange(0, BT)
    mr = i < L
    rows = row0 + i
    kk = kb * BKB + tl.arange(0, BKB)
    mk = kk < K
    dt = HS.dtype.element_ty
    s_base = (c * HV + hv) * K * V
    dqg = tl.zeros([BT, BKB], tl.float32)
    dkd = tl.zeros([BT, BKB], tl.float32)
    dw = tl.zeros([BT, BKB], tl.float32)
    dgc = tl.zeros([BKB], tl.float32)
    daqk = tl.zeros([BT, BT], tl.float32)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        mv = vv < V
        v_off = (rows * HV + hv)[:, None] * V + vv[None, :]
        m = mr[:, None] & mv[None, :]
        ms = mk[:, None] & mv[None, :]
        do = tl.load(DO + v_off, mask=m, other=0.0).to(dt)
        u = tl.load(VNEW + v_off, mask=m, other=0.0)
        du = tl.load(DU + v_off, mask=m, other=0.0).to(dt)
        hs = tl.load(HS + s_base + kk[:, None] * V + vv[None, :], mask=ms, other=0.0)
        dh = tl.load(DH + s_base + kk[:, None] * V + vv[None, :], mask=ms, other=0.0)
        dqg += tl.dot(do, tl.trans(hs), input_precision=PREC)
        dkd += tl.dot(u, tl.trans(dh), input_precision=PREC)
        dw -= tl.dot(du, tl.trans(hs), input_precision=PREC)
        dgc += tl.sum(hs.to(tl.float32) * dh.to(tl.float32), 1)
        if kb == 0:
            daqk += tl.dot(do, tl.trans(u), input_precision=PREC)
    k_off = (rows * HV + hv)[:, None] * K + kk[None, :]
    mrk = mr[:, None] & mk[None, :]
    tl.store(DQG + k_off, dqg, mask=mrk)
    tl.store(DKD + k_off, dkd, mask=mrk)
    tl.store(DW + k_off, dw, mask=mrk)
    tl.store(DGC + (c * HV + hv) * K + kk, dgc, mask=mk)
    if kb == 0:
        tl.store(DAQK + (rows * HV + hv)[:, None] * BT + i[None, :], daqk, mask=mr[:, None])


@triton.jit
def _kda_bwd_factored(qs, ks, Xa, Gm, dAqk, dA, DOT_PREC: tl.constexpr, ROUND_TF32: tl.constexpr):
    """The decayed products of the backward factored relative to the middle token (every |Gm| of the
    slice <= FACTOR_MAX): P1, P3, P2 + P4 (see ``_kda_bwd_pairwise``) and their pair terms of dG,
    qs P1 - ks (P2 + P4) + Xa P3. dAqk / dA are zero above the diagonal, so no product of two large
    factors is ever formed for i < j. The row sums (P1, P3) and column sums (P2, P4) of the same pair
    terms cancel in the reverse cumulative sum of dG: with tf32 products (ROUND_TF32) the factors are
    rounded to tf32 once and the same rounded values scale both sides, which keeps them consistent."""
    eP = tl.exp(Gm)
    eN = tl.exp(-Gm)
    fa = qs * eP
    fb = ks * eN
    fc = Xa * eP
    if ROUND_TF32:
        fa = _kda_round_tf32(fa)
        fb = _kda_round_tf32(fb)
        fc = _kda_round_tf32(fc)
    d1 = tl.dot(dAqk, fb, input_precision=DOT_PREC)
    d2 = tl.dot(tl.trans(dAqk), fa, input_precision=DOT_PREC)
    d3 = tl.dot(dA, fb, input_precision=DOT_PREC)
    d4 = tl.dot(tl.trans(dA), fc, input_precision=DOT_PREC)
    return eP * d1, eP * d3, eN * (d2 + d4), fa * d1 - fb * (d2 + d4) + fc * d3


@triton.jit
def _kda_bwd_factored_pairs(dGp, Ra, Rx, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """The pair terms' part of the gate parameters' gradients (``_kda_tangent_sum``) on a factored slice, per
    channel: sum_{i >= j} pair_ij (W_i - W_j) = sum_i (W_i - W_r) dGp_i for any row r (each pair adds to dGp at
    i and subtracts at j). Ra, Rx: W_i - W_r for the A_log and dt_bias tangents, r the middle of the chunk's rows,
    (L - 1) // 2: the rounding of every dGp_i is weighted by |W_i - W_r|, and the middle row keeps that at most
    half the chunk's cumulative tangent (CPU property seed 241, a 23-row chunk: dA_log at 0.81 of the error rule
    with r = the factors' row 31, 0.15 with r = 11); with fp32 inputs a slice whose weight exceeds TANGENT_MAX
    takes the exact products instead. Returns (A_log part, dt_bias part)."""
    pwa = tl.zeros([dGp.shape[1]], tl.float32)
    pwx = tl.zeros([dGp.shape[1]], tl.float32)
    if GATE != 0:
        pwa = tl.sum(Ra * dGp, 0)
        if HAS_DT_BIAS:
            pwx = tl.sum(Rx * dGp, 0)
    return pwa, pwx


@triton.jit
def _kda_block_pairs(pair, W, Wl, on, NB: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, TWO_FLOAT: tl.constexpr):
    """sum_{i, j} pair_ij (W_i - W_j) per channel over one diagonal block (``on`` selects it) of the cumulative
    tangent W + Wl; pair (BC_i, BC_j, BK) is zero above the diagonal."""
    Ws = tl.sum(tl.where(on, tl.reshape(W, (NB, BC, BK)), 0.0), 0)
    Ls = tl.sum(tl.where(on, tl.reshape(Wl, (NB, BC, BK)), 0.0), 0)
    Wij = _kda_gdiff(Ws[:, None, :], Ls[:, None, :], Ws[None, :, :], Ls[None, :, :], TWO_FLOAT)
    return tl.sum(tl.sum(pair * Wij, 0), 0)


@triton.jit
def _kda_bwd_pairwise(G, Gl, qs, ks, Xa, dAqk, dA, i, Wa, Wal, Wx, Wxl, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, DOT_PREC: tl.constexpr, ROUND_TF32: tl.constexpr, TWO_FLOAT: tl.constexpr,
                      GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """The decayed products of the backward with exact per-channel decays (strong decays, -inf
    included; no exponent > 0), for one K slice: P1, P3, P2 + P4 and the pair terms of dG
    (qs P1 - ks (P2 + P4) + Xa P3) with
    P1_i = sum_j dAqk_ij ks_j E_ij, P2_j = sum_i dAqk_ij qs_i E_ij, P3_i = sum_j dA_ij ks_j E_ij,
    P4_j = sum_i dA_ij Xa_i E_ij, E_ij = exp(G_i - G_j), i >= j.
    Off-diagonal 16x16 blocks are factored at the row block's boundary token (as in the prep; the
    tf32 factors rounded once for both sides, as in ``_kda_bwd_factored``), diagonal blocks are
    pairwise in fp32. G + Gl: the cumulative log decays in two floats (``_kda_cumsum``).

    Also the pair terms' part of the gate parameters' gradients (``_kda_tangent_sum``), per channel:
    sum_{i >= j} pair_ij (W_i - W_j) for the cumulative tangents Wa + Wal (A_log, with a gate) and Wx + Wxl
    (dt_bias), each pair weighted by the tangent over the tokens it decays across: on the off-diagonal blocks
    relative to the row block's boundary token (as the factors), on the diagonal blocks pair by pair. Returns
    (P1, P3, P24, dGp, pairs' A_log part, pairs' dt_bias part)."""
    NB: tl.constexpr = BT // BC
    blk = i // BC
    # (runtime loops, not unrolled: this rare path would otherwise add seconds of compile time)
    Gr = G                                                             # G - G_ref (G_ref = 0 for block 0)
    for sa in range(1, NB):
        Gr = tl.where(blk[:, None] == sa, _kda_rel(G, Gl, i, sa * BC - 1, TWO_FLOAT), Gr)
    eR = tl.exp(Gr)                                                    # row factor, exponent <= 0
    fq = qs * eR
    fx = Xa * eR
    if ROUND_TF32:
        fq = _kda_round_tf32(fq)
        fx = _kda_round_tf32(fx)
    d1 = tl.zeros([BT, BK], tl.float32)
    d3 = tl.zeros([BT, BK], tl.float32)
    P24 = tl.zeros([BT, BK], tl.float32)
    dGp = tl.zeros([BT, BK], tl.float32)
    pwa = tl.zeros([BK], tl.float32)
    pwx = tl.zeros([BK], tl.float32)
    for sa in range(1, NB):
        # column factor exp(G_ref(a) - G_j) for the columns before row block a (exponent <= 0), else 0
        cf = tl.exp(tl.where(i[:, None] < sa * BC, -_kda_rel(G, Gl, i, sa * BC - 1, TWO_FLOAT), float("-inf")))
        sel = (blk == sa)[:, None]
        fb = ks * cf
        if ROUND_TF32:
            fb = _kda_round_tf32(fb)
        r1 = tl.where(sel, tl.dot(dAqk, fb, input_precision=DOT_PREC), 0.0)
        r3 = tl.where(sel, tl.dot(dA, fb, input_precision=DOT_PREC), 0.0)
        c24 = (tl.dot(tl.trans(dAqk), tl.where(sel, fq, 0.0), input_precision=DOT_PREC)
               + tl.dot(tl.trans(dA), tl.where(sel, fx, 0.0), input_precision=DOT_PREC))
        d1 += r1
        d3 += r3
        P24 += cf * c24
        dGs = fq * r1 + fx * r3 - fb * c24
        dGp += dGs
        if GATE != 0:        # rows of block a and columns before it, weighted relative to its boundary token
            pwa += tl.sum(_kda_rel(Wa, Wal, i, sa * BC - 1, TWO_FLOAT) * dGs, 0)
            if HAS_DT_BIAS:
                pwx += tl.sum(_kda_rel(Wx, Wxl, i, sa * BC - 1, TWO_FLOAT) * dGs, 0)
    P1 = eR * d1
    P3 = eR * d3
    # diagonal blocks: pairwise exp(G_i - G_j), i >= j inside each 16-token block, one block at a time
    s4 = tl.arange(0, NB)
    r4 = tl.arange(0, BC)
    eye = (s4[:, None] == s4[None, :])[:, None, :, None]
    tri = (r4[:, None] >= r4[None, :])[:, :, None]
    dq4 = tl.sum(tl.where(eye, tl.reshape(dAqk, (NB, BC, NB, BC)), 0.0), 2)       # (NB, BC, BC)
    da4 = tl.sum(tl.where(eye, tl.reshape(dA, (NB, BC, NB, BC)), 0.0), 2)
    G4 = tl.reshape(G, (NB, BC, BK))
    L4 = tl.reshape(Gl, (NB, BC, BK))
    q4 = tl.reshape(qs, (NB, BC, BK))
    k4 = tl.reshape(ks, (NB, BC, BK))
    x4 = tl.reshape(Xa, (NB, BC, BK))
    for sb in range(0, NB):
        on = (s4 == sb)[:, None, None]
        Gs = tl.sum(tl.where(on, G4, 0.0), 0)                                          # (BC, BK)
        Ls = tl.sum(tl.where(on, L4, 0.0), 0)
        Gij = _kda_gdiff(Gs[:, None, :], Ls[:, None, :], Gs[None, :, :], Ls[None, :, :], TWO_FLOAT)
        E = tl.exp(tl.where(tri, Gij, float("-inf")))                                  # (BC_i, BC_j, BK)
        dqs_ = tl.sum(tl.where(on, dq4, 0.0), 0)[:, :, None]
        das_ = tl.sum(tl.where(on, da4, 0.0), 0)[:, :, None]
        kE = tl.sum(tl.where(on, k4, 0.0), 0)[None, :, :] * E
        qb = tl.sum(tl.where(on, q4, 0.0), 0)[:, None, :]
        xb = tl.sum(tl.where(on, x4, 0.0), 0)[:, None, :]
        qE = qb * E
        xE = xb * E
        p1 = tl.sum(dqs_ * kE, 1)
        p3 = tl.sum(das_ * kE, 1)
        p2 = tl.sum(dqs_ * qE, 0)
        p4 = tl.sum(das_ * xE, 0)
        # place the (BC, BK) results at rows sb*BC ... sb*BC + BC - 1
        p1 = tl.reshape(tl.where(on, p1[None, :, :], 0.0), (BT, BK))
        p3 = tl.reshape(tl.where(on, p3[None, :, :], 0.0), (BT, BK))
        p24 = tl.reshape(tl.where(on, (p2 + p4)[None, :, :], 0.0), (BT, BK))
        P1 += p1
        P3 += p3
        P24 += p24
        dGp += qs * p1 - ks * p24 + Xa * p3
        if GATE != 0:        # the block's pairs (i >= j), each weighted by W_i - W_j
            pair = (dqs_ * qb + das_ * xb) * kE
            pwa += _kda_block_pairs(pair, Wa, Wal, on, NB, BC, BK, TWO_FLOAT)
            if HAS_DT_BIAS:
                pwx += _kda_block_pairs(pair, Wx, Wxl, on, NB, BC, BK, TWO_FLOAT)
    return P1, P3, P24, dGp, pwa, pwx


@triton.jit
def _kda_bwd_intra_kernel(q, k, v, g, beta, A_log, dt_bias, chunk_info, TM,
                            DU, DQG, DKD, DW, DAQK, DGC,
                            DQ, DK, DQO, DKO, DV, DB, DG, DALOG, DDT, FLAGS,
                            scale, lower_bound, H, HV,
                            K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
                            HAS_DT_BIAS: tl.constexpr, FLOOR: tl.constexpr, FACTOR_MAX: tl.constexpr,
                            TANGENT_MAX: tl.constexpr, DOT_PREC: tl.constexpr, ROUND_TF32: tl.constexpr,
                            EXACT: tl.constexpr, TWO_FLOAT: tl.constexpr):
    """Backward through one 64-token chunk (parallel over chunks x value heads), from the partial
    gradients of ``_kda_bwd_chunk_grads_kernel``: the UT transform, the decayed
    intra-chunk products, the cumulative decays, the clamp, the gate and the l2 norm.

    Two launches: EXACT=False (every chunk, factored products only: the strong-decay code is compiled
    out, which keeps registers for the common case) flags the (chunk, head) pairs with a K slice that
    decays by more than FACTOR_MAX from the middle token (or, fp32 with a gate, whose cumulative gate tangent
    spreads by more than TANGENT_MAX from the chunk's middle row: ``_kda_bwd_factored_pairs``); EXACT=True
    returns at once for unflagged pairs and redoes the flagged ones with the exact per-block products where
    needed.

    The gate parameters' gradients of the chunk (DALOG (NC, HV): summed over K; DDT (NC, HV, K): dt_bias, per
    channel) are formed from the parts of the log-decay gradient, each weighted by the cumulative tangent over
    the tokens it spans (``_kda_tangent_sum``), not as sums of the per-token gradients times the tangent."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    if EXACT:
        if tl.load(FLAGS + c * HV + hv) == 0:
            return
    ch = _kda_chunk_rows(chunk_info, beta, c, hv, H, HV, K, V, BT)
    gate = _kda_head_gate(g, dt_bias, A_log, lower_bound, hv, GATE)
    a_off = (ch.rows * HV + hv)[:, None] * BT + ch.i[None, :]
    nq, rk = _kda_row_norms_sliced(q, k, ch.q_off, ch.mr, K, BT, BK, L2NORM)
    rq = nq * scale
    T = tl.load(TM + a_off, mask=ch.mr[:, None], other=0.0)
    db = tl.zeros([BT], tl.float32)
    dT = tl.zeros([BT, BT], tl.float32)
    # 1. U = T (beta v): dv = beta T^T dU, dbeta += v . T^T dU, dT += dU (beta v)^T
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        m = ch.mr[:, None] & (vc[None, :] < V)
        vs = tl.load(v + ch.v_off + vc[None, :], mask=m, other=0.0).to(tl.float32)
        du = tl.load(DU + ch.v_off + vc[None, :], mask=m, other=0.0).to(tl.float32)
        dbv = tl.dot(tl.trans(T), du, input_precision=DOT_PREC)
        tl.store(DV + ch.v_off + vc[None, :], (ch.b[:, None] * dbv).to(DV.dtype.element_ty), mask=m)
        db += tl.sum(vs * dbv, 1)
        dT += tl.dot(du, tl.trans(ch.b[:, None] * vs), input_precision=DOT_PREC)
    # 2. W = T Kb with Kb = beta exp(G) k: dT += dW Kb^T, K slice by K slice
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m = ch.mr[:, None] & (cols[None, :] < K)
        ks = tl.load(k + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
        x_, d, G, Gl_ = _kda_chunk_decay(gate, ch.g_off + cols[None, :], hv, cols, m, K, GATE, HAS_DT_BIAS, FLOOR,
                                         TWO_FLOAT)
        dw = tl.load(DW + ch.g_off + cols[None, :], mask=m, other=0.0)
        dT += tl.dot(dw, tl.trans(ch.b[:, None] * ks * tl.exp(G)), input_precision=DOT_PREC)
    # 3. T = (I + A)^-1: dA = -T^T dT T^T (strictly lower); dAqk lower-triangular
    dA = -tl.dot(tl.dot(tl.trans(T), dT, input_precision=DOT_PREC), tl.trans(T), input_precision=DOT_PREC)
    dA = tl.where(ch.i[:, None] > ch.i[None, :], dA, 0.0)
    dAqk = tl.load(DAQK + a_off, mask=ch.mr[:, None], other=0.0)
    dAqk = tl.where(ch.i[:, None] >= ch.i[None, :], dAqk, 0.0)
    # 4. per K slice: through the decayed products, qg, kd, Kb, the cumulative sum, floor and gate
    dotq = tl.zeros([BT], tl.float32)
    dotk = tl.zeros([BT], tl.float32)
    dal = tl.zeros([BK], tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        mc = cols < K
        m = ch.mr[:, None] & mc[None, :]
        qr = tl.load(q + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
        kr = tl.load(k + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
        qs = qr * rq[:, None]
        ks = kr * rk[:, None]
        x, d, G, Gl = _kda_chunk_decay(gate, ch.g_off + cols[None, :], hv, cols, m, K, GATE, HAS_DT_BIAS, FLOOR,
                                       TWO_FLOAT)
        dx, dA_ = _kda_gate_grads(x, gate.a, gate.lower_bound, GATE)
        # the cumulative tangents of the floored log decay along A_log and dt_bias (in two floats, as G)
        # (Ra, Rx: relative to the chunk's middle row, for the factored products)
        Wa, Wal = G, Gl
        Wx, Wxl = G, Gl
        Ra = G
        Rx = G
        if GATE != 0:
            Wa, Wal = _kda_cumsum(_kda_tangent(dA_, d, m, FLOOR), FLOOR, TWO_FLOAT)
            Ra = _kda_rel(Wa, Wal, ch.i, (ch.L - 1) // 2, TWO_FLOAT)
            if HAS_DT_BIAS:
                Wx, Wxl = _kda_cumsum(_kda_tangent(dx, d, m, FLOOR), FLOOR, TWO_FLOAT)
                Rx = _kda_rel(Wx, Wxl, ch.i, (ch.L - 1) // 2, TWO_FLOAT)
        G_last = _kda_row_at(G, ch.i, ch.L - 1)
        eG = tl.exp(G)
        eL = tl.exp(-_kda_rel(G, Gl, ch.i, ch.L - 1, TWO_FLOAT))
        Xa = ch.b[:, None] * ks
        dqg = tl.load(DQG + ch.g_off + cols[None, :], mask=m, other=0.0)
        dkd = tl.load(DKD + ch.g_off + cols[None, :], mask=m, other=0.0)
        dw = tl.load(DW + ch.g_off + cols[None, :], mask=m, other=0.0)
        dgc = tl.load(DGC + (c * HV + hv) * K + cols, mask=mc, other=0.0)
        dKb = tl.dot(tl.trans(T), dw, input_precision=DOT_PREC)
        Gm = _kda_rel(G, Gl, ch.i, BT // 2 - 1, TWO_FLOAT)
        fast = tl.max(tl.max(tl.abs(Gm), 1), 0) <= FACTOR_MAX
        if GATE != 0:
            if TWO_FLOAT:       # fp32: a tangent spread over more than TANGENT_MAX takes the exact products too
                fast = fast & (tl.max(tl.max(tl.abs(Ra), 1), 0) <= TANGENT_MAX)
                if HAS_DT_BIAS:
                    fast = fast & (tl.max(tl.max(tl.abs(Rx), 1), 0) <= TANGENT_MAX)
        if EXACT:
            if fast:
                P1, P3, P24, dGp = _kda_bwd_factored(qs, ks, Xa, Gm, dAqk, dA, DOT_PREC, ROUND_TF32)
                pwa, pwx = _kda_bwd_factored_pairs(dGp, Ra, Rx, GATE, HAS_DT_BIAS)
            else:
                P1, P3, P24, dGp, pwa, pwx = _kda_bwd_pairwise(G, Gl, qs, ks, Xa, dAqk, dA, ch.i, Wa, Wal, Wx, Wxl,
                                                               BT, BC, BK, DOT_PREC, ROUND_TF32, TWO_FLOAT, GATE,
                                                               HAS_DT_BIAS)
        else:
            if not fast:        # this chunk is redone by the EXACT launch (whatever is written here)
                tl.store(FLAGS + c * HV + hv, 1)
            P1, P3, P24, dGp = _kda_bwd_factored(qs, ks, Xa, Gm, dAqk, dA, DOT_PREC, ROUND_TF32)
            pwa, pwx = _kda_bwd_factored_pairs(dGp, Ra, Rx, GATE, HAS_DT_BIAS)
        dqs = eG * dqg + P1
        dks = P24 + ch.b[:, None] * P3 + eL * dkd + ch.b[:, None] * eG * dKb
        db += tl.sum(ks * P3, 1) + tl.sum(eG * ks * dKb, 1)
        # d/dG of qs e^G, (k_i E_ij k_j), (q_i E_ij k_j), beta k e^G; then to the per-token log decays d_t
        # (G_i = sum_{s<=i} d_s): a reverse cumulative sum. kd = k e^(G_last - G) and e^(G_last) depend on
        # d_t through G_last - G_i = sum_{i<s<=L-1} d_s: an exclusive forward sum plus a constant, formed
        # directly (total minus reverse partial sums would cancel catastrophically near the chunk's end)
        dGo = tl.where(m, qs * eG * dqg + Xa * eG * dKb, 0.0)
        dG = tl.where(m, dGo + dGp, 0.0)
        kdd = ks * eL * dkd
        end = tl.exp(G_last) * dgc
        dd = tl.cumsum(dG, 0, reverse=True) + (tl.cumsum(kdd, 0) - kdd) + end[None, :]
        dd = tl.where(d < -FLOOR, 0.0, dd)       # a select that keeps a NaN gate NaN (see _kda_floor)
        tl.store(DG + ch.g_off + cols[None, :], dd * dx, mask=m)
        if GATE != 0:
            dal += _kda_tangent_sum(Wa, Wal, dGo, kdd, end, ch.i, ch.L, TWO_FLOAT) + pwa
            if HAS_DT_BIAS:
                tl.store(DDT + (c * HV + hv) * K + cols, _kda_tangent_sum(Wx, Wxl, dGo, kdd, end, ch.i, ch.L, TWO_FLOAT)
                         + pwx, mask=mc)
        gq = dqs * rq[:, None]
        gk = dks * rk[:, None]
        if L2NORM:
            dotq += tl.sum(gq * qr, 1)
            dotk += tl.sum(gk * kr, 1)
        if L2NORM:                               # r dy to the fp32 scratch, for step 5
            tl.store(DQ + ch.g_off + cols[None, :], gq, mask=m)
            tl.store(DK + ch.g_off + cols[None, :], gk, mask=m)
        else:
            tl.store(DQO + ch.g_off + cols[None, :], gq, mask=m)
            tl.store(DKO + ch.g_off + cols[None, :], gk, mask=m)
    tl.store(DB + ch.rows * HV + hv, db, mask=ch.mr)
    if GATE != 0:
        tl.store(DALOG + c * HV + hv, tl.sum(dal, 0))
    # 5. l2 norm backward
    if L2NORM:
        _kda_l2norm_bwd_rows(q, k, DQ, DK, DQO, DKO, ch.q_off, ch.g_off, ch.mr, nq, rk, dotq, dotk, K, BK)

