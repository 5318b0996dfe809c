"""Chunked Kimi Delta Attention kernels (Triton): forward and backward.

Algorithm (chunks of BT = 16 tokens, one value head per program):

* ``_kda_fwd_prep_kernel`` (parallel over chunks): per chunk, the log decays (raw, or through the
  in-kernel gate) are clamped at ``-DECAY_FLOOR`` (exp(-30) ~ 1e-13: a reset in fp32) and
  cumulated per channel *inside the chunk only* (small magnitudes, so differences stay exact).
  Every intra-chunk decay factor is formed pairwise, ``exp(G_i - G_j)`` with i >= j, so no exponent
  is ever positive whatever the decay (no lower bound needed; -inf is a reset).
  Then the WY / UT transform: ``T = (I + strictly_lower(beta_i k_i . D_ij . k_j))^-1`` by forward
  substitution, ``U = T (beta v)``, ``W = T (beta exp(G) k)``, and the output operands
  ``qg = exp(G) q``, ``kd = exp(G_last - G) k``, ``Aqk_ij = q_i . D_ij . k_j`` (i >= j).
* ``_kda_fwd_scan_kernel`` (sequential over chunks, parallel over sequences x heads x V blocks):
  the fp32 state S (K x BV) stays in registers: ``u = U - W S``, ``o = qg S + Aqk u``,
  ``S <- exp(G_last) S + kd^T u``. Optionally stores the chunk-start states for the backward.
* ``_kda_bwd_scan_kernel`` (reverse over chunks): the state gradient dS in fp32:
  ``du = Aqk^T dO + kd dS``, ``dS <- exp(G_last) dS + qg^T dO - W^T du`` and the per-chunk
  partial gradients of qg, kd, W, Aqk and exp(G_last) (one slice per V block).
* ``_kda_bwd_intra_kernel`` (parallel over chunks): back through the UT transform, the pairwise
  decays, the per-chunk cumulative sum, the clamp, the gate and the l2 norm.
"""
from __future__ import annotations


import triton
import triton.language as tl

from .. import _triton_interpreter

DECAY_FLOOR = 30.0
L2NORM_EPS = 1e-6


_triton_interpreter.patch()


@triton.jit
def _kda_gate(x, a, lower_bound, GATE: tl.constexpr):
    """Log decay from the gate input: raw (0), -a*softplus(x) (1), lower_bound*sigmoid(a*x) (2)."""
    if GATE == 1:
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        return -a * sp
    elif GATE == 2:
        return lower_bound * tl.sigmoid(a * x)
    else:
        return x


@triton.jit
def _kda_l2norm_bwd_rows(q, k, DQ, DK, q_off, g_off, mr, nq, rk, dotq, dotk, K: tl.constexpr, BK: tl.constexpr):
    """L2-norm backward of a chunk's rows, in place: dx = r (dy - y (y . dy)) with y = r x, where DQ / DK
    hold r * dy so far and dotq / dotk the row sums of (r * dy) * x; nq, rk are the rows' 1 / |x|."""
    tl.debug_barrier()
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m = mr[:, None] & (cols[None, :] < K)
        qq = tl.load(q + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
        kraw = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
        gq = tl.load(DQ + g_off + cols[None, :], mask=m, other=0.0)
        gk = tl.load(DK + g_off + cols[None, :], mask=m, other=0.0)
        gq = gq - qq * (nq * nq * dotq)[:, None]
        gk = gk - kraw * (rk * rk * dotk)[:, None]
        tl.store(DQ + g_off + cols[None, :], gq, mask=m)
        tl.store(DK + g_off + cols[None, :], gk, mask=m)


@triton.jit
def _kda_gate_grads(x, a, lower_bound, GATE: tl.constexpr):
    """(d decay / d x, d decay / d A_log) of ``_kda_gate``."""
    if GATE == 1:
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        return -a * tl.sigmoid(x), -a * sp
    elif GATE == 2:
        s = tl.sigmoid(a * x)
        ds = lower_bound * s * (1.0 - s)
        return ds * a, ds * a * x
    else:
        return tl.full(x.shape, 1.0, tl.float32), tl.zeros(x.shape, tl.float32)


@triton.jit
def _kda_load_decay(g, dt_bias, a, lower_bound, g_off, hv, cols, mask, K: tl.constexpr,
                    GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """Gate input x and the log decay d (fp32, before the floor) of one (rows x cols) tile."""
    x = tl.load(g + g_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        x += tl.load(dt_bias + hv * K + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
    d = _kda_gate(x, a, lower_bound, GATE)
    return x, d


@triton.jit
def _kda_chunk_decay(g, dt_bias, a, lower_bound, g_off, hv, cols, mask, K: tl.constexpr, GATE: tl.constexpr,
                     HAS_DT_BIAS: tl.constexpr, FLOOR: tl.constexpr):
    """``_kda_load_decay`` and G, the log decay floored at -FLOOR and summed over the chunk's rows up to
    each row (0 on masked rows): (x, d, G)."""
    x, d = _kda_load_decay(g, dt_bias, a, lower_bound, g_off, hv, cols, mask, K, GATE, HAS_DT_BIAS)
    return x, d, tl.cumsum(tl.where(mask, tl.maximum(d, -FLOOR), 0.0), 0)


@triton.jit
def _kda_tri_inverse(A, BT: tl.constexpr):
    """(I + A)^-1 for strictly lower-triangular A (BT x BT) by forward substitution."""
    i = tl.arange(0, BT)
    T = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    for r in tl.static_range(1, BT):
        a = tl.sum(tl.where(i[:, None] == r, A, 0.0), 0)          # row r of A, indexed by column j
        t = tl.sum(a[:, None] * T, 0)                              # sum_j A_rj T_j
        T = tl.where(i[:, None] == r, T - t[None, :], T)
    return T


@triton.jit
def _kda_row_norms_tile(qf, kf, scale, L2NORM: tl.constexpr):
    """Row factors from full (BT x KP) tiles: q_used = rq * q (scale folded in), k_used = rk * k."""
    if L2NORM:
        nq = 1.0 / tl.sqrt(tl.sum(qf * qf, 1) + 1e-6)
        nk = 1.0 / tl.sqrt(tl.sum(kf * kf, 1) + 1e-6)
    else:
        nq = tl.full([qf.shape[0]], 1.0, tl.float32)
        nk = tl.full([qf.shape[0]], 1.0, tl.float32)
    return nq * scale, nk, nq


@triton.jit
def _kda_chunk_rows(chunk_info, A_log, beta, c, hv, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    GATE: tl.constexpr):
    """The rows of chunk c for value head hv (chunk_info: (sequence, first row, length) per chunk):
    the q / k head h = hv // (HV // H), the chunk's length L, the row index i, its mask, the packed
    rows, the row offsets of q / k, g and v, the gate's a = exp(A_log) (1 without a gate) and beta."""
    h = hv // (HV // H)
    row0 = tl.load(chunk_info + c * 3 + 1).to(tl.int64)
    L = tl.load(chunk_info + c * 3 + 2)
    i = tl.arange(0, BT)
    mr = i < L
    rows = row0 + i
    q_off = (rows * H + h)[:, None] * K
    g_off = (rows * HV + hv)[:, None] * K
    v_off = (rows * HV + hv)[:, None] * V
    a = 1.0
    if GATE != 0:
        a = tl.exp(tl.load(A_log + hv).to(tl.float32))
    b = tl.load(beta + rows * HV + hv, mask=mr, other=0.0).to(tl.float32)
    return h, L, i, mr, rows, q_off, g_off, v_off, a, b


@triton.jit
def _kda_fwd_prep_kernel(q, k, v, g, beta, A_log, dt_bias, chunk_info,
                         W, U, QG, KD, AQK, TM, GC,
                         scale, lower_bound, H, HV,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, KP: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
                         HAS_DT_BIAS: tl.constexpr, FLOOR: tl.constexpr, FACTOR_MAX: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    h, L, i, mr, rows, q_off, g_off, v_off, a, b = _kda_chunk_rows(chunk_info, A_log, beta, c, hv, H, HV, K, V,
                                                                   BT, GATE)
    kk = tl.arange(0, KP)
    mrk = mr[:, None] & (kk[None, :] < K)
    qf = tl.load(q + q_off + kk[None, :], mask=mrk, other=0.0).to(tl.float32)
    kf = tl.load(k + q_off + kk[None, :], mask=mrk, other=0.0).to(tl.float32)
    rq, rk, nq = _kda_row_norms_tile(qf, kf, scale, L2NORM)
    tril = i[:, None] >= i[None, :]
    # 1. intra-chunk products with per-channel decays exp(G_i - G_j), i >= j. When every |G| of the
    #    chunk is <= FACTOR_MAX, exp(G_i - G_j) = exp(G_i) exp(-G_j) stays in fp32 range: two
    #    small dots. Otherwise (strong decays) the exact pairwise form, K slice by K slice.
    xg, d = _kda_load_decay(g, dt_bias, a, lower_bound, g_off + kk[None, :], hv, kk, mrk, K, GATE, HAS_DT_BIAS)
    Gf = tl.cumsum(tl.where(mrk, tl.maximum(d, -FLOOR), 0.0), 0)
    if tl.max(tl.max(tl.abs(Gf), 1), 0) <= FACTOR_MAX:
        qs = qf * rq[:, None]
        ks = kf * rk[:, None]
        eP = tl.exp(Gf)
        kn = ks * tl.exp(-Gf)
        akk = tl.dot(ks * eP, tl.trans(kn), input_precision=DOT_PREC)
        aqk = tl.dot(qs * eP, tl.trans(kn), input_precision=DOT_PREC)
        Gl = tl.sum(tl.where(i[:, None] == L - 1, Gf, 0.0), 0)
        tl.store(QG + g_off + kk[None, :], (qs * eP).to(QG.dtype.element_ty), mask=mrk)
        tl.store(KD + g_off + kk[None, :], (ks * tl.exp(Gl[None, :] - Gf)).to(KD.dtype.element_ty), mask=mrk)
        tl.store(GC + (c * HV + hv) * K + kk, tl.exp(Gl), mask=kk < K)
    else:
        akk = tl.zeros([BT, BT], tl.float32)
        aqk = tl.zeros([BT, BT], tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            m = mr[:, None] & (cols[None, :] < K)
            qs = tl.load(q + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rq[:, None]
            ks = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
            xs_, ds_, G = _kda_chunk_decay(g, dt_bias, a, lower_bound, g_off + cols[None, :], hv, cols, m, K, GATE,
                                           HAS_DT_BIAS, FLOOR)
            G_last = tl.sum(tl.where(i[:, None] == L - 1, G, 0.0), 0)
            E = tl.exp(tl.where(tril[:, :, None], G[:, None, :] - G[None, :, :], float("-inf")))
            akk += tl.sum(ks[:, None, :] * ks[None, :, :] * E, 2)
            aqk += tl.sum(qs[:, None, :] * ks[None, :, :] * E, 2)
            tl.store(QG + g_off + cols[None, :], (qs * tl.exp(G)).to(QG.dtype.element_ty), mask=m)
            tl.store(KD + g_off + cols[None, :], (ks * tl.exp(G_last[None, :] - G)).to(KD.dtype.element_ty), mask=m)
            tl.store(GC + (c * HV + hv) * K + cols, tl.exp(G_last), mask=cols < K)
    # 2. UT transform: T = (I + strictly_lower(beta_i k_i D_ij k_j))^-1
    akk = tl.where(i[:, None] > i[None, :], b[:, None] * akk, 0.0)
    aqk = tl.where(tril, aqk, 0.0)
    T = _kda_tri_inverse(akk, BT)
    a_off = (rows * HV + hv)[:, None] * BT + i[None, :]
    tl.store(AQK + a_off, aqk, mask=mr[:, None])
    tl.store(TM + a_off, T, mask=mr[:, None])
    # 3. U = T (beta v), W = T (beta exp(G) k)
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        m = mr[:, None] & (vc[None, :] < V)
        vs = tl.load(v + v_off + vc[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.dot(T, b[:, None] * vs, input_precision=DOT_PREC)
        tl.store(U + v_off + vc[None, :], u.to(U.dtype.element_ty), mask=m)
    w = tl.dot(T, b[:, None] * kf * rk[:, None] * tl.exp(Gf), input_precision=DOT_PREC)
    tl.store(W + g_off + kk[None, :], w.to(W.dtype.element_ty), mask=mrk)


@triton.jit
def _kda_fwd_scan_kernel(W, U, QG, KD, AQK, GC, h0, seq_info, O, VNEW, HS, HT, HV, NCMAX,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr,
                         BV: tl.constexpr, USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                         STORE_H: tl.constexpr):
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
        u = uu - tl.dot(w, Sd)
        ud = u.to(dt)
        o = tl.dot(qg, Sd) + tl.dot(A.to(dt), ud)
        tl.store(O + v_off, o.to(O.dtype.element_ty), mask=mrv)
        if STORE_H:
            tl.store(VNEW + v_off, ud, mask=mrv)
        S = S * gc[:, None] + tl.dot(tl.trans(kd), ud)
    if STORE_FINAL:
        tl.store(HT + (n * HV + hv) * K * V + s_off, S, mask=ms)


@triton.jit
def _kda_bwd_scan_kernel(W, QG, KD, AQK, GC, HS, VNEW, DO, dht, seq_info,
                         DU, DQG, DKD, DW, DAQK, DGC, DH0, DH, R, NC, HV, NCMAX,
                         K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr,
                         BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                         PARTIALS: tl.constexpr = True):
    """PARTIALS: the per-V-block partial gradients of qg, kd, W, Aqk, exp(G_last) are formed here;
    else only du and the chunk-end state gradients DH are stored (the partials come from
    ``chunk64._kda_bwd_chunk_grads_kernel``, parallel over chunks, over the full V)."""
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
    # per-V-block slices of the partial gradients
    pk = iv.to(tl.int64) * R * HV * K
    pa = iv.to(tl.int64) * R * HV * BT
    pg = iv.to(tl.int64) * NC * HV * K
    dS = tl.zeros([KP, BV], tl.float32)
    if USE_DHT:
        dS += tl.load(dht + (n * HV + hv) * K * V + s_off, mask=ms, other=0.0).to(tl.float32)
    nc = tl.cdiv(Tn, BT)
    for cc in range(0, NCMAX):
        c = NCMAX - 1 - cc
        live = c < nc
        mr = c * BT + i < Tn
        rows = row0 + c * BT + i
        k_off = (rows * HV + hv)[:, None] * K + kk[None, :]
        v_off = (rows * HV + hv)[:, None] * V + vv[None, :]
        a_off = (rows * HV + hv)[:, None] * BT + i[None, :]
        mrk = mr[:, None] & mk[None, :]
        mrv = mr[:, None] & mv[None, :]
        w = tl.load(W + k_off, mask=mrk, other=0.0)
        qg = tl.load(QG + k_off, mask=mrk, other=0.0)
        kd = tl.load(KD + k_off, mask=mrk, other=0.0)
        A = tl.load(AQK + a_off, mask=mr[:, None], other=0.0).to(dt)
        gc = tl.load(GC + ((cbase + c) * HV + hv) * K + kk, mask=mk & live, other=1.0)
        do = tl.load(DO + v_off, mask=mrv, other=0.0).to(dt)
        dSd = dS.to(dt)
        # du = Aqk^T dO + kd dS_end
        du = tl.dot(tl.trans(A), do) + tl.dot(kd, dSd)
        dud = du.to(dt)
        tl.store(DU + v_off, du, mask=mrv)
        if PARTIALS:
            hs = tl.load(HS + ((cbase + c) * HV + hv) * K * V + s_off, mask=ms & live, other=0.0)
            u = tl.load(VNEW + v_off, mask=mrv, other=0.0)
            tl.store(DQG + pk + k_off, tl.dot(do, tl.trans(hs)), mask=mrk)
            tl.store(DKD + pk + k_off, tl.dot(u, tl.trans(dSd)), mask=mrk)
            tl.store(DW + pk + k_off, -tl.dot(dud, tl.trans(hs)), mask=mrk)
            tl.store(DAQK + pa + a_off, tl.dot(do, tl.trans(u)), mask=mr[:, None])
            tl.store(DGC + pg + ((cbase + c) * HV + hv) * K + kk, tl.sum(hs.to(tl.float32) * dS, 1), mask=mk & live)
        else:
            tl.store(DH + ((cbase + c) * HV + hv) * K * V + s_off, dSd, mask=ms & live)
        # dS_start = exp(G_last) dS_end + qg^T dO - W^T du
        dS = dS * gc[:, None] + tl.dot(tl.trans(qg), do) - tl.dot(tl.trans(w), dud)
    if STORE_DH0:
        tl.store(DH0 + (n * HV + hv) * K * V + s_off, dS, mask=ms)


@triton.jit
def _kda_bwd_intra_kernel(q, k, v, g, beta, A_log, dt_bias, chunk_info, TM, GC,
                          DU, DQG, DKD, DW, DAQK, DGC,
                          DQ, DK, DV, DB, DG, DALOG,
                          scale, lower_bound, R, NC, H, HV, NV,
                          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, KP: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
                          HAS_DT_BIAS: tl.constexpr, FLOOR: tl.constexpr, FACTOR_MAX: tl.constexpr,
                          DOT_PREC: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    h, L, i, mr, rows, q_off, g_off, v_off, a, b = _kda_chunk_rows(chunk_info, A_log, beta, c, hv, H, HV, K, V,
                                                                   BT, GATE)
    a_off = (rows * HV + hv)[:, None] * BT + i[None, :]
    kk = tl.arange(0, KP)
    mrk = mr[:, None] & (kk[None, :] < K)
    qf = tl.load(q + q_off + kk[None, :], mask=mrk, other=0.0).to(tl.float32)
    kf = tl.load(k + q_off + kk[None, :], mask=mrk, other=0.0).to(tl.float32)
    rq, rk, nq = _kda_row_norms_tile(qf, kf, scale, L2NORM)
    T = tl.load(TM + a_off, mask=mr[:, None], other=0.0)
    tril = i[:, None] >= i[None, :]
    db = tl.zeros([BT], tl.float32)
    dT = tl.zeros([BT, BT], tl.float32)
    # 1. U = T (beta v): dv = beta T^T dU, dbeta += v . T^T dU, dT += dU (beta v)^T
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        m = mr[:, None] & (vc[None, :] < V)
        vs = tl.load(v + v_off + vc[None, :], mask=m, other=0.0).to(tl.float32)
        du = tl.load(DU + v_off + vc[None, :], mask=m, other=0.0)
        dbv = tl.dot(tl.trans(T), du, input_precision=DOT_PREC)
        tl.store(DV + v_off + vc[None, :], (b[:, None] * dbv).to(DV.dtype.element_ty), mask=m)
        db += tl.sum(vs * dbv, 1)
        dT += tl.dot(du, tl.trans(b[:, None] * vs), input_precision=DOT_PREC)
    # 2. W = T Kb with Kb = beta exp(G) k: dT += dW Kb^T (full K tile)
    xf, df = _kda_load_decay(g, dt_bias, a, lower_bound, g_off + kk[None, :], hv, kk, mrk, K, GATE, HAS_DT_BIAS)
    Gf = tl.cumsum(tl.where(mrk, tl.maximum(df, -FLOOR), 0.0), 0)
    ksf = kf * rk[:, None]
    dwf = tl.zeros([BT, KP], tl.float32)
    for p in range(0, NV):
        dwf += tl.load(DW + p * R * HV * K + g_off + kk[None, :], mask=mrk, other=0.0)
    dT += tl.dot(dwf, tl.trans(b[:, None] * ksf * tl.exp(Gf)), input_precision=DOT_PREC)
    # 3. T = (I + A)^-1: dA = -T^T dT T^T (strictly lower); dAqk summed over V blocks (lower)
    dA = -tl.dot(tl.dot(tl.trans(T), dT, input_precision=DOT_PREC), tl.trans(T), input_precision=DOT_PREC)
    dA = tl.where(i[:, None] > i[None, :], dA, 0.0)
    dAqk = tl.zeros([BT, BT], tl.float32)
    for p in range(0, NV):
        dAqk += tl.load(DAQK + p * R * HV * BT + a_off, mask=mr[:, None], other=0.0)
    dAqk = tl.where(tril, dAqk, 0.0)
    # 4. per channel: through the pairwise decays, qg, kd, Kb, the cumulative sum, floor and gate
    dotq = tl.zeros([BT], tl.float32)
    dotk = tl.zeros([BT], tl.float32)
    dal = tl.zeros([BT], tl.float32)
    if tl.max(tl.max(tl.abs(Gf), 1), 0) <= FACTOR_MAX:
        # factored decays (every |G| <= FACTOR_MAX): the pairwise sums are small dots
        qs = qf * rq[:, None]
        ks = kf * rk[:, None]
        G_last = tl.sum(tl.where(i[:, None] == L - 1, Gf, 0.0), 0)
        eG = tl.exp(Gf)
        eN = tl.exp(-Gf)
        kd = ks * tl.exp(G_last[None, :] - Gf)
        Kb = b[:, None] * ks * eG
        dqg = tl.zeros([BT, KP], tl.float32)
        dkd = tl.zeros([BT, KP], tl.float32)
        dgc = tl.zeros([KP], tl.float32)
        for p in range(0, NV):
            dqg += tl.load(DQG + p * R * HV * K + g_off + kk[None, :], mask=mrk, other=0.0)
            dkd += tl.load(DKD + p * R * HV * K + g_off + kk[None, :], mask=mrk, other=0.0)
            dgc += tl.load(DGC + p * NC * HV * K + (c * HV + hv) * K + kk, mask=kk < K, other=0.0)
        dKb = tl.dot(tl.trans(T), dwf, input_precision=DOT_PREC)
        Xa = b[:, None] * ks
        P1 = eG * tl.dot(dAqk, ks * eN, input_precision=DOT_PREC)
        P2 = eN * tl.dot(tl.trans(dAqk), qs * eG, input_precision=DOT_PREC)
        P3 = eG * tl.dot(dA, ks * eN, input_precision=DOT_PREC)
        P4 = eN * tl.dot(tl.trans(dA), Xa * eG, input_precision=DOT_PREC)
        dqs = eG * dqg + P1
        dks = P2 + P4 + b[:, None] * P3 + tl.exp(G_last[None, :] - Gf) * dkd + b[:, None] * eG * dKb
        db += tl.sum(ks * P3, 1) + tl.sum(eG * ks * dKb, 1)
        dG = qs * dqs - ks * (P2 + P4) + Xa * P3 + Kb * dKb - kd * dkd
        dG += tl.where(i[:, None] == L - 1, (tl.sum(kd * dkd, 0) + tl.exp(G_last) * dgc)[None, :], 0.0)
        dG = tl.where(mrk, dG, 0.0)
        dd = tl.cumsum(dG, 0, reverse=True)
        dd = tl.where(df > -FLOOR, dd, 0.0)
        dx, dA_ = _kda_gate_grads(xf, a, lower_bound, GATE)
        tl.store(DG + g_off + kk[None, :], dd * dx, mask=mrk)
        if GATE != 0:
            dal += tl.sum(tl.where(mrk, dd * dA_, 0.0), 1)
        gq = dqs * rq[:, None]
        gk = dks * rk[:, None]
        if L2NORM:
            dotq += tl.sum(gq * qf, 1)
            dotk += tl.sum(gk * kf, 1)
        tl.store(DQ + g_off + kk[None, :], gq, mask=mrk)
        tl.store(DK + g_off + kk[None, :], gk, mask=mrk)
    else:
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            mc = cols < K
            m = mr[:, None] & mc[None, :]
            qr = tl.load(q + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
            kr = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
            qs = qr * rq[:, None]
            ks = kr * rk[:, None]
            x, d, G = _kda_chunk_decay(g, dt_bias, a, lower_bound, g_off + cols[None, :], hv, cols, m, K, GATE,
                                       HAS_DT_BIAS, FLOOR)
            live = d > -FLOOR
            G_last = tl.sum(tl.where(i[:, None] == L - 1, G, 0.0), 0)
            eG = tl.exp(G)
            kd = ks * tl.exp(G_last[None, :] - G)
            Kb = b[:, None] * ks * eG
            E = tl.exp(tl.where(tril[:, :, None], G[:, None, :] - G[None, :, :], float("-inf")))
            dqg = tl.zeros([BT, BK], tl.float32)
            dkd = tl.zeros([BT, BK], tl.float32)
            dw = tl.zeros([BT, BK], tl.float32)
            dgc = tl.zeros([BK], tl.float32)
            for p in range(0, NV):
                dqg += tl.load(DQG + p * R * HV * K + g_off + cols[None, :], mask=m, other=0.0)
                dkd += tl.load(DKD + p * R * HV * K + g_off + cols[None, :], mask=m, other=0.0)
                dw += tl.load(DW + p * R * HV * K + g_off + cols[None, :], mask=m, other=0.0)
                dgc += tl.load(DGC + p * NC * HV * K + (c * HV + hv) * K + cols, mask=mc, other=0.0)
            dKb = tl.dot(tl.trans(T), dw)
            Xa = b[:, None] * ks
            P1 = tl.sum(dAqk[:, :, None] * ks[None, :, :] * E, 1)      # row side of Aqk
            P2 = tl.sum(dAqk[:, :, None] * qs[:, None, :] * E, 0)      # column side of Aqk
            P3 = tl.sum(dA[:, :, None] * ks[None, :, :] * E, 1)        # row side of A (beta_i k_i)
            P4 = tl.sum(dA[:, :, None] * Xa[:, None, :] * E, 0)        # column side of A
            dqs = eG * dqg + P1
            dks = P2 + P4 + b[:, None] * P3 + tl.exp(G_last[None, :] - G) * dkd + b[:, None] * eG * dKb
            db += tl.sum(ks * P3, 1) + tl.sum(eG * ks * dKb, 1)
            dG = qs * dqs - ks * (P2 + P4) + Xa * P3 + Kb * dKb - kd * dkd
            dG += tl.where(i[:, None] == L - 1, (tl.sum(kd * dkd, 0) + tl.exp(G_last) * dgc)[None, :], 0.0)
            dG = tl.where(m, dG, 0.0)
            dd = tl.cumsum(dG, 0, reverse=True)
            dd = tl.where(live, dd, 0.0)
            dx, dA_ = _kda_gate_grads(x, a, lower_bound, GATE)
            tl.store(DG + g_off + cols[None, :], dd * dx, mask=m)
            if GATE != 0:
                dal += tl.sum(tl.where(m, dd * dA_, 0.0), 1)
            # gradients of the normalised q / k (scale folded); l2norm backward below
            gq = dqs * rq[:, None]
            gk = dks * rk[:, None]
            if L2NORM:
                dotq += tl.sum(gq * qr, 1)
                dotk += tl.sum(gk * kr, 1)
            tl.store(DQ + g_off + cols[None, :], gq, mask=m)
            tl.store(DK + g_off + cols[None, :], gk, mask=m)
    tl.store(DB + rows * HV + hv, db, mask=mr)
    if GATE != 0:
        tl.store(DALOG + c * HV + hv, tl.sum(dal, 0))
    # 5. l2 norm backward
    if L2NORM:
        _kda_l2norm_bwd_rows(q, k, DQ, DK, q_off, g_off, mr, nq, rk, dotq, dotk, K, BK)
