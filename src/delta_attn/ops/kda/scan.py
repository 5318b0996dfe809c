"""State scan and output stage of KDA (Triton): sequential over chunks, parallel over sequences x value
heads x V blocks.

The fp32 state block S (K x BV) stays in registers while the program walks its sequence's chunks, reading
the intra-chunk stage's operands (``intra.py``) once: ``u = U - W S`` (the delta-rule correction),
``o = qg S + Aqk u`` (the output), ``S <- exp(G_last) S + kd^T u`` (the state update). The training forward
also stores the chunk-start states and u for the backward (``STORE_H``). ``PREC`` is the dots' input
precision: ``ieee`` for fp32 inputs (fp32-accurate), ``tf32`` otherwise (bf16 operands, or the fp32 work
dtype of fp16 inputs, whose 10-bit mantissa tf32 keeps).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _triton_interpreter

_triton_interpreter.patch()


@triton.jit
def _kda_fwd_scan_kernel(W, U, QG, KD, AQK, GC, h0, seq_info, O, VNEW, HS, HT, HV, NCMAX,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr,
                         BV: tl.constexpr, USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                         STORE_H: tl.constexpr, PREC: tl.constexpr):
    iv = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    hv = tl.program_id(2).to(tl.int64)
    row0 = tl.load(seq_info + n * 3).to(tl.int64)
    Tn = tl.load(seq_info + n * 3 + 1)
    cbase = tl.load(seq_info + n * 3 + 2).to(tl.int64)
    i = tl.arange(0, BT)
    kk = tl.arange(0, KP)
    vv = iv * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    dt = W.dtype.element_ty
    s_off = kk[:, None] * V + vv[None, :]
    ms = mk[:, None] & mv[None, :]
    S = tl.zeros([KP, BV], tl.float32)
    if USE_H0:
        S += tl.load(h0 + (n * HV + hv) * K * V + s_off, mask=ms, other=0.0).to(tl.float32)
    # NCMAX (host int) = the longest sequence's chunk count; past this sequence's end every load is
    # masked and the iteration leaves S unchanged
    nc = tl.cdiv(Tn, BT)
    for c in range(0, NCMAX):
        live = c < nc
        mr = c * BT + i < Tn
        rows = row0 + c * BT + i
        k_off = (rows * HV + hv)[:, None] * K + kk[None, :]
        v_off = (rows * HV + hv)[:, None] * V + vv[None, :]
        mrk = mr[:, None] & mk[None, :]
        mrv = mr[:, None] & mv[None, :]
        w = tl.load(W + k_off, mask=mrk, other=0.0)
        qg = tl.load(QG + k_off, mask=mrk, other=0.0)
        kd = tl.load(KD + k_off, mask=mrk, other=0.0)
        uu = tl.load(U + v_off, mask=mrv, other=0.0).to(tl.float32)
        A = tl.load(AQK + (rows * HV + hv)[:, None] * BT + i[None, :], mask=mr[:, None], other=0.0)
        gc = tl.load(GC + ((cbase + c) * HV + hv) * K + kk, mask=mk & live, other=1.0)
        if STORE_H:
            tl.store(HS + ((cbase + c) * HV + hv) * K * V + s_off, S.to(HS.dtype.element_ty), mask=ms & live)
        Sd = S.to(dt)
        # u = U - W S ; o = qg S + Aqk u ; S <- exp(G_last) S + kd^T u
        u = uu - tl.dot(w, Sd, input_precision=PREC)
        ud = u.to(dt)
        o = tl.dot(qg, Sd, input_precision=PREC) + tl.dot(A.to(dt), ud, input_precision=PREC)
        tl.store(O + v_off, o.to(O.dtype.element_ty), mask=mrv)
        if STORE_H:
            tl.store(VNEW + v_off, ud, mask=mrv)
        S = S * gc[:, None] + tl.dot(tl.trans(kd), ud, input_precision=PREC)
    if STORE_FINAL:
        tl.store(HT + (n * HV + hv) * K * V + s_off, S, mask=ms)
