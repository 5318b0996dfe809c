"""State scan and output stage of KDA (Triton): sequential over chunks, parallel over sequences x value
heads x V blocks.

The fp32 state block S (K x BV) stays in registers while the program walks its sequence's chunks, reading
the intra-chunk stage's operands (``kernels_intra.py``) once: ``u = U - W S`` (the delta-rule correction),
``o = qg S + Aqk u`` (the output), ``S <- exp(G_last) S + kd^T u`` (the state update). The training forward
also stores the chunk-start states and u for the backward (``STORE_H``). ``TRANSITION`` scans the transition
of context parallelism's carried rows instead (``launch.transition_scan``): zero values (no U read) and the
identity as initial state (V = K), so O is the response ``u_t`` (``o_t(S) = o_t(0) + u_t S``) and the final
state the transition M (``S_end = M S + B``). ``PREC`` is the dots' input
precision: ``ieee`` for fp32 inputs (fp32-accurate), ``tf32`` otherwise (bf16 operands, or the fp32 work
dtype of fp16 inputs, whose 10-bit mantissa tf32 keeps).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scan_program(seq_info, HV, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr):
    """A scan program's chain (sequence n, value head hv, V block): the sequence's first packed row, length and
    first chunk, the state block's K and V indices, masks and offsets (s_off into a (K, V) state), and the
    offset of this chain's (K, V) state in an (N, HV, K, V) tensor."""
    iv = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    hv = tl.program_id(2).to(tl.int64)
    row0 = tl.load(seq_info + n * 3).to(tl.int64)
    Tn = tl.load(seq_info + n * 3 + 1)
    cbase = tl.load(seq_info + n * 3 + 2).to(tl.int64)
    kk = tl.arange(0, KP)
    vv = iv * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    s_off = kk[:, None] * V + vv[None, :]
    return hv, row0, Tn, cbase, kk, vv, mk, mv, s_off, mk[:, None] & mv[None, :], (n * HV + hv) * K * V


@triton.jit
def _scan_rows(row0, Tn, t0, hv, HV, BR: tl.constexpr, K: tl.constexpr, V: tl.constexpr, kk, vv, mk, mv):
    """Rows t0 ... t0 + BR - 1 of a sequence (first packed row row0, length Tn): packed rows, row mask, the
    offsets of the K-wide (W, qg, kd) and V-wide (U, o, u) tiles, and their masks."""
    i = tl.arange(0, BR)
    mr = t0 + i < Tn
    rows = row0 + t0 + i
    k_off = (rows * HV + hv)[:, None] * K + kk[None, :]
    v_off = (rows * HV + hv)[:, None] * V + vv[None, :]
    return rows, mr, k_off, v_off, mr[:, None] & mk[None, :], mr[:, None] & mv[None, :]


@triton.jit
def _kda_fwd_scan_kernel(W, U, QG, KD, AQK, GC, h0, seq_info, O, VNEW, HS, HT, HV, NCMAX,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr,
                         BV: tl.constexpr, USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                         STORE_H: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
                         TRANSITION: tl.constexpr = False):
    hv, row0, Tn, cbase, kk, vv, mk, mv, s_off, ms, st = _scan_program(seq_info, HV, K, V, KP, BV)
    i = tl.arange(0, BT)
    dt = W.dtype.element_ty
    S = tl.zeros([KP, BV], tl.float32)
    if USE_H0:
        S += tl.load(h0 + st + s_off, mask=ms, other=0.0).to(tl.float32)
    if TRANSITION:          # the identity as initial state (V = K)
        S += tl.where((kk[:, None] == vv[None, :]) & ms, 1.0, 0.0)
    # NCMAX (host int) = the longest sequence's chunk count; past this sequence's end every load is
    # masked and the iteration leaves S unchanged
    nc = tl.cdiv(Tn, BT)
    for c in range(0, NCMAX):
        live = c < nc
        gc = tl.load(GC + ((cbase + c) * HV + hv) * K + kk, mask=mk & live, other=1.0)
        if STORE_H:
            tl.store(HS + ((cbase + c) * HV + hv) * K * V + s_off, S.to(HS.dtype.element_ty), mask=ms & live)
        Sd = S.to(dt)
        # u = U - W S ; o = qg S + Aqk u ; S <- exp(G_last) S + kd^T u
        if SPLIT == 1:
            rows, mr, k_off, v_off, mrk, mrv = _scan_rows(row0, Tn, c * BT, hv, HV, BT, K, V, kk, vv, mk, mv)
            if TRANSITION:  # zero values
                u = tl.zeros([BT, BV], tl.float32)
            else:
                u = tl.load(U + v_off, mask=mrv, other=0.0).to(tl.float32)
            u -= tl.dot(tl.load(W + k_off, mask=mrk, other=0.0), Sd, input_precision=PREC)
            ud = u.to(dt)
            A = tl.load(AQK + (rows * HV + hv)[:, None] * BT + i[None, :], mask=mr[:, None], other=0.0)
            o = tl.dot(tl.load(QG + k_off, mask=mrk, other=0.0), Sd, input_precision=PREC)
            o += tl.dot(A.to(dt), ud, input_precision=PREC)
            tl.store(O + v_off, o.to(O.dtype.element_ty), mask=mrv)
            if STORE_H:
                tl.store(VNEW + v_off, ud, mask=mrv)
            S = S * gc[:, None] + tl.dot(tl.trans(tl.load(KD + k_off, mask=mrk, other=0.0).to(dt)), ud,
                                         input_precision=PREC)
        else:
            # the chunk as two row halves a, b (half the tile memory): Aqk = [[A_aa, 0], [A_ba, A_bb]]
            BR: tl.constexpr = BT // 2
            j = tl.arange(0, BR)
            ra, ma, ka, va, mka, mva = _scan_rows(row0, Tn, c * BT, hv, HV, BR, K, V, kk, vv, mk, mv)
            rb, mb, kb, vb, mkb, mvb = _scan_rows(row0, Tn, c * BT + BR, hv, HV, BR, K, V, kk, vv, mk, mv)
            if TRANSITION:  # zero values
                ua = tl.zeros([BR, BV], tl.float32)
                ub = tl.zeros([BR, BV], tl.float32)
            else:
                ua = tl.load(U + va, mask=mva, other=0.0).to(tl.float32)
                ub = tl.load(U + vb, mask=mvb, other=0.0).to(tl.float32)
            ua -= tl.dot(tl.load(W + ka, mask=mka, other=0.0), Sd, input_precision=PREC)
            ub -= tl.dot(tl.load(W + kb, mask=mkb, other=0.0), Sd, input_precision=PREC)
            uad = ua.to(dt)
            ubd = ub.to(dt)
            a_aa = tl.load(AQK + (ra * HV + hv)[:, None] * BT + j[None, :], mask=ma[:, None], other=0.0).to(dt)
            oa = tl.dot(tl.load(QG + ka, mask=mka, other=0.0), Sd, input_precision=PREC)
            oa += tl.dot(a_aa, uad, input_precision=PREC)
            tl.store(O + va, oa.to(O.dtype.element_ty), mask=mva)
            a_ba = tl.load(AQK + (rb * HV + hv)[:, None] * BT + j[None, :], mask=mb[:, None], other=0.0).to(dt)
            a_bb = tl.load(AQK + (rb * HV + hv)[:, None] * BT + BR + j[None, :], mask=mb[:, None], other=0.0).to(dt)
            ob = tl.dot(tl.load(QG + kb, mask=mkb, other=0.0), Sd, input_precision=PREC)
            ob += tl.dot(a_ba, uad, input_precision=PREC) + tl.dot(a_bb, ubd, input_precision=PREC)
            tl.store(O + vb, ob.to(O.dtype.element_ty), mask=mvb)
            if STORE_H:
                tl.store(VNEW + va, uad, mask=mva)
                tl.store(VNEW + vb, ubd, mask=mvb)
            S = S * gc[:, None] + tl.dot(tl.trans(tl.load(KD + ka, mask=mka, other=0.0).to(dt)), uad,
                                         input_precision=PREC)
            S += tl.dot(tl.trans(tl.load(KD + kb, mask=mkb, other=0.0).to(dt)), ubd, input_precision=PREC)
    if STORE_FINAL:
        tl.store(HT + st + s_off, S, mask=ms)
