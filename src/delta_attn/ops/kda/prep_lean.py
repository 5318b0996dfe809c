"""Forward-only prep (the default for a forward without gradient: ``CONFIG["fwd_variant"] = "lean_dots"``,
env ``DELTA_ATTN_KDA_FWD_VARIANT``; 16- or 32-token chunks): the same per-chunk operands as ``chunk._kda_fwd_prep_kernel`` for a
forward without gradient, with less code in the common case and fewer bytes.

* Two launches. ``EXACT=False`` (every chunk): the factored products ``exp(G_i) exp(-G_j)`` only (the
  strong-decay code is compiled out: fewer registers and instructions); a chunk whose within-chunk
  cumulative decay exceeds ``FACTOR_MAX`` writes its flag and stops. ``EXACT=True`` returns at once for
  unflagged chunks and redoes the flagged ones with the exact pairwise decays, K slice by K slice.
* No UT matrix T is stored (only the backward needs it); Aqk is stored in the working dtype (the scan
  casts it to that anyway: bf16 for bf16 inputs, half the bytes of fp32).
* ``INV=1``: ``(I + A)^-1`` of the strictly lower BT x BT ``A`` as the product
  ``(I - A)(I + A^2)(I + A^4)(I + A^8)`` (BT = 16; A is nilpotent: ``A^16 = 0``; one more factor per
  doubling of BT), six small dots in ``INV_PREC`` instead of the 15 dependent steps of forward
  substitution (``INV=0``, as the default kernel).
* BT = 16 or 32 (``CONFIG["lean_chunk"]``): at 32 the sequential scan walks half as many chunks; the
  exact launch then uses K slices of BK = 4 for its BT x BT x BK pairwise tiles.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk import _kda_chunk_decay, _kda_chunk_rows, _kda_tri_inverse


@triton.jit
def _kda_tri_inverse_dots(A, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for strictly lower-triangular A (BT = 16, 32 or 64; A^BT = 0):
    (I + M)(I + M^2)(I + M^4) ... (I + M^(BT/2)), M = -A."""
    i = tl.arange(0, BT)
    eye = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    P = -A
    T = eye + P
    for s in tl.static_range(5):
        if BT > (2 << s):
            P = tl.dot(P, P, input_precision=PREC)
            T = tl.dot(T, eye + P, input_precision=PREC)
    return T


@triton.jit
def _kda_fwd_prep_lean_kernel(q, k, v, g, beta, A_log, dt_bias, chunk_info,
                              W, U, QG, KD, AQK, GC, FLAGS,
                              scale, lower_bound, H, HV,
                              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                              BV: tl.constexpr, KS: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
                              HAS_DT_BIAS: tl.constexpr, FLOOR: tl.constexpr, FACTOR_MAX: tl.constexpr,
                              DOT_PREC: tl.constexpr, EXACT: tl.constexpr, INV: tl.constexpr,
                              INV_PREC: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    if EXACT:
        if tl.load(FLAGS + c * HV + hv) == 0:
            return
    h, L, i, mr, rows, q_off, g_off, v_off, a, b = _kda_chunk_rows(chunk_info, A_log, beta, c, hv, H, HV, K, V,
                                                                   BT, GATE)
    tril = i[:, None] >= i[None, :]
    # 1. row norms of q and k, K slice by K slice (KS = KP: one slice)
    sq = tl.zeros([BT], tl.float32)
    sk = tl.zeros([BT], tl.float32)
    if L2NORM:
        for k0 in range(0, K, KS):
            cols = k0 + tl.arange(0, KS)
            m = mr[:, None] & (cols[None, :] < K)
            qx = tl.load(q + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
            kx = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
            sq += tl.sum(qx * qx, 1)
            sk += tl.sum(kx * kx, 1)
        rk = 1.0 / tl.sqrt(sk + 1e-6)
        rq = scale / tl.sqrt(sq + 1e-6)
    else:
        rk = tl.full([BT], 1.0, tl.float32)
        rq = tl.full([BT], 1.0, tl.float32) * scale
    # 2. intra-chunk products with per-channel decays exp(G_i - G_j), i >= j; G = the floored log
    #    decays cumulated inside the chunk (per K slice: a cumulative sum over rows only)
    akk = tl.zeros([BT, BT], tl.float32)
    aqk = tl.zeros([BT, BT], tl.float32)
    if EXACT:
        # 2x. exact pairwise products, K slice by K slice (BK)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            m = mr[:, None] & (cols[None, :] < K)
            qs_ = tl.load(q + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rq[:, None]
            ks_ = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
            xs_, ds_, G = _kda_chunk_decay(g, dt_bias, a, lower_bound, g_off + cols[None, :], hv, cols, m, K, GATE,
                                           HAS_DT_BIAS, FLOOR)
            G_last = tl.sum(tl.where(i[:, None] == L - 1, G, 0.0), 0)
            E = tl.exp(tl.where(tril[:, :, None], G[:, None, :] - G[None, :, :], float("-inf")))
            akk += tl.sum(ks_[:, None, :] * ks_[None, :, :] * E, 2)
            aqk += tl.sum(qs_[:, None, :] * ks_[None, :, :] * E, 2)
            tl.store(QG + g_off + cols[None, :], (qs_ * tl.exp(G)).to(QG.dtype.element_ty), mask=m)
            tl.store(KD + g_off + cols[None, :], (ks_ * tl.exp(G_last[None, :] - G)).to(KD.dtype.element_ty),
                     mask=m)
            tl.store(GC + (c * HV + hv) * K + cols, tl.exp(G_last), mask=cols < K)
    else:
        # 2f. factored products exp(G_i) exp(-G_j), valid when every |G| of the chunk is <= FACTOR_MAX;
        #     otherwise the chunk is flagged (what this launch wrote for it is overwritten by EXACT)
        bad = 0.0
        for k0 in range(0, K, KS):
            cols = k0 + tl.arange(0, KS)
            m = mr[:, None] & (cols[None, :] < K)
            qs = tl.load(q + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rq[:, None]
            ks = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
            xs_, ds_, G = _kda_chunk_decay(g, dt_bias, a, lower_bound, g_off + cols[None, :], hv, cols, m, K, GATE,
                                           HAS_DT_BIAS, FLOOR)
            bad = tl.maximum(bad, tl.max(tl.max(tl.abs(G), 1), 0))
            eP = tl.exp(G)
            kn = ks * tl.exp(-G)
            akk += tl.dot(ks * eP, tl.trans(kn), input_precision=DOT_PREC)
            aqk += tl.dot(qs * eP, tl.trans(kn), input_precision=DOT_PREC)
            G_last = tl.sum(tl.where(i[:, None] == L - 1, G, 0.0), 0)
            tl.store(QG + g_off + cols[None, :], (qs * eP).to(QG.dtype.element_ty), mask=m)
            tl.store(KD + g_off + cols[None, :], (ks * tl.exp(G_last[None, :] - G)).to(KD.dtype.element_ty),
                     mask=m)
            tl.store(GC + (c * HV + hv) * K + cols, tl.exp(G_last), mask=cols < K)
        fast = bad <= FACTOR_MAX
        tl.store(FLAGS + c * HV + hv, tl.where(fast, 0, 1).to(tl.int32))
        if not fast:
            return
    # 3. UT transform: T = (I + strictly_lower(beta_i k_i D_ij k_j))^-1; Aqk stored (i >= j)
    akk = tl.where(i[:, None] > i[None, :], b[:, None] * akk, 0.0)
    aqk = tl.where(tril, aqk, 0.0)
    if INV == 1:
        T = _kda_tri_inverse_dots(akk, BT, INV_PREC)
    else:
        T = _kda_tri_inverse(akk, BT)
    tl.store(AQK + (rows * HV + hv)[:, None] * BT + i[None, :], aqk.to(AQK.dtype.element_ty), mask=mr[:, None])
    # 4. U = T (beta v), W = T (beta exp(G) k)
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        m = mr[:, None] & (vc[None, :] < V)
        vs = tl.load(v + v_off + vc[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.dot(T, b[:, None] * vs, input_precision=DOT_PREC)
        tl.store(U + v_off + vc[None, :], u.to(U.dtype.element_ty), mask=m)
    for k0 in range(0, K, KS):
        cols = k0 + tl.arange(0, KS)
        m = mr[:, None] & (cols[None, :] < K)
        ks = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
        xs_, ds_, G = _kda_chunk_decay(g, dt_bias, a, lower_bound, g_off + cols[None, :], hv, cols, m, K, GATE,
                                       HAS_DT_BIAS, FLOOR)
        w = tl.dot(T, (b[:, None] * ks) * tl.exp(G), input_precision=DOT_PREC)
        tl.store(W + g_off + cols[None, :], w.to(W.dtype.element_ty), mask=m)
