"""KDA forward on 64-token chunks (4 sub-chunks of 16): the per-chunk preparation kernel.

Opt-in (``CONFIG["fwd_chunk"] = 64`` / ``DELTA_ATTN_KDA_FWD_CHUNK=64``), forward only. It produces the
same per-chunk operands as ``chunk._kda_fwd_prep_kernel`` (W, U, qg, kd, Aqk, exp(G_last)) at BT = 64,
so the sequential ``_kda_fwd_scan_kernel`` (generic in BT) walks 4x fewer chunks on 64-row tiles.

``_kda_fwd_prep64_kernel``, one program per (64-token chunk, value head):

0. row norms of q and k (``use_qk_l2norm``), K slice by K slice.
1. per K slice: the chunk-local cumulative log decay G (per channel, each token clamped at -FLOOR),
   the output operands ``qg = exp(G) q``, ``kd = exp(G_last - G) k``, ``exp(G_last)``, and the
   intra-chunk products ``Akk_ij = k_i . D_ij . k_j`` and ``Aqk_ij = q_i . D_ij . k_j`` (i >= j)
   with ``D_ij = diag(exp(G_i - G_j))``:
   * fast (every |G - G_mid| of the slice <= FACTOR_MAX, G_mid = G at the chunk's middle token, so
     a chunk may decay by up to 2 x FACTOR_MAX): exp(G_i - G_j) = exp(G_i - G_mid) exp(G_mid - G_j),
     both factors in fp32 range, two 64x64 tensor-core products;
   * safe (strong decays, -inf included; no exponent is ever > 0):
     - off-diagonal 16x16 blocks (row sub-chunk a > column sub-chunk b): factored at the sub-chunk
       boundary, exp(G_i - G_ref(a)) exp(G_ref(a) - G_j) with G_ref(a) = G at the last token before
       sub-chunk a: i comes after it and j before it, so both exponents are <= 0;
     - diagonal 16x16 blocks: exact per-channel pairwise exp(G_i - G_j), i >= j, in narrow K slices.
2. UT transform ``T = (I + strictly_lower(beta_i Akk_ij))^-1`` by block forward substitution: the
   four 16x16 diagonal blocks are inverted at once (forward substitution); with ``Dinv`` their
   block-diagonal inverse and ``M = Dinv N`` (N: the strictly block-lower part, so M^4 = 0),
   ``T = (I + M)^-1 Dinv = (I - M + M^2 - M^3) Dinv``, evaluated as ``X <- Dinv - M X`` three times.
3. ``U = T (beta v)``, ``W = T (beta exp(G) k)``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk import _kda_load_decay


@triton.jit
def _kda_block_tri_inverse(A, BT: tl.constexpr, BC: tl.constexpr, DOT_PREC: tl.constexpr):
    """(I + A)^-1 for strictly lower-triangular A (BT x BT) by block forward substitution on BC blocks."""
    NB: tl.constexpr = BT // BC
    s = tl.arange(0, NB)
    r = tl.arange(0, BC)
    eye = s[:, None] == s[None, :]
    # diagonal blocks D[n] = A[n*BC:(n+1)*BC, n*BC:(n+1)*BC], shape (NB, BC, BC)
    A4 = tl.reshape(A, (NB, BC, NB, BC))
    D = tl.sum(tl.where(eye[:, None, :, None], A4, 0.0), 2)
    # forward substitution on every diagonal block at once: Ti[n] = (I + D[n])^-1
    Ti = tl.zeros((NB, BC, BC), tl.float32) + tl.where(r[:, None] == r[None, :], 1.0, 0.0)[None, :, :]
    for rr in tl.static_range(1, BC):
        arow = tl.sum(tl.where(r[None, :, None] == rr, D, 0.0), 1)           # row rr of D[n], by column
        t = tl.sum(arow[:, :, None] * Ti, 1)                                  # sum_j D[n]_rr,j Ti[n]_j
        Ti = tl.where(r[None, :, None] == rr, Ti - t[:, None, :], Ti)
    Dinv = tl.reshape(tl.where(eye[:, None, :, None], Ti[:, :, None, :], 0.0), (BT, BT))
    # off-diagonal blocks: T = (I - M + M^2 - ...) Dinv with M = Dinv N nilpotent (Horner form)
    blk = tl.arange(0, BT) // BC
    N = tl.where(blk[:, None] > blk[None, :], A, 0.0)
    M = tl.dot(Dinv, N, input_precision=DOT_PREC)
    X = Dinv
    for it in tl.static_range(1, NB):
        X = Dinv - tl.dot(M, X, input_precision=DOT_PREC)
    return X


@triton.jit
def _kda_row_at(G, i, r):
    """Row r of a (rows x cols) tile, as a cols vector."""
    return tl.sum(tl.where(i[:, None] == r, G, 0.0), 0)


@triton.jit
def _kda_fwd_prep64_kernel(q, k, v, g, beta, A_log, dt_bias, chunk_info,
                           W, U, QG, KD, AQK, GC,
                           scale, lower_bound, H, HV,
                           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                           BK: tl.constexpr, BKD: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                           GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, FLOOR: tl.constexpr,
                           FACTOR_MAX: tl.constexpr, DOT_PREC: tl.constexpr):
    NB: tl.constexpr = BT // BC
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    h = hv // (HV // H)
    row0 = tl.load(chunk_info + c * 3 + 1).to(tl.int64)
    L = tl.load(chunk_info + c * 3 + 2)
    i = tl.arange(0, BT)
    mr = i < L
    rows = row0 + i
    blk = i // BC                                   # sub-chunk of each row
    q_off = (rows * H + h)[:, None] * K
    g_off = (rows * HV + hv)[:, None] * K
    v_off = (rows * HV + hv)[:, None] * V
    a = 1.0
    if GATE != 0:
        a = tl.exp(tl.load(A_log + hv).to(tl.float32))
    b = tl.load(beta + rows * HV + hv, mask=mr, other=0.0).to(tl.float32)
    # 0. row factors: q_used = rq * q (scale folded in), k_used = rk * k
    rq = tl.full([BT], 1.0, tl.float32)
    rk = tl.full([BT], 1.0, tl.float32)
    if L2NORM:
        sq = tl.zeros([BT], tl.float32)
        sk = tl.zeros([BT], tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            m = mr[:, None] & (cols[None, :] < K)
            qr = tl.load(q + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
            kr = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
            sq += tl.sum(qr * qr, 1)
            sk += tl.sum(kr * kr, 1)
        rq = 1.0 / tl.sqrt(sq + 1e-6)
        rk = 1.0 / tl.sqrt(sk + 1e-6)
    rq = rq * scale
    # 1. per K slice: decays, output operands, intra-chunk products
    akk = tl.zeros([BT, BT], tl.float32)
    aqk = tl.zeros([BT, BT], tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m = mr[:, None] & (cols[None, :] < K)
        qs = tl.load(q + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rq[:, None]
        ks = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
        x_, d = _kda_load_decay(g, dt_bias, a, lower_bound, g_off + cols[None, :], hv, cols, m, K, GATE,
                               HAS_DT_BIAS)
        G = tl.cumsum(tl.where(m, tl.maximum(d, -FLOOR), 0.0), 0)     # chunk-local, <= 0, finite
        G_last = _kda_row_at(G, i, L - 1)
        tl.store(QG + g_off + cols[None, :], (qs * tl.exp(G)).to(QG.dtype.element_ty), mask=m)
        tl.store(KD + g_off + cols[None, :], (ks * tl.exp(G_last[None, :] - G)).to(KD.dtype.element_ty), mask=m)
        tl.store(GC + (c * HV + hv) * K + cols, tl.exp(G_last), mask=cols < K)
        Gm = G - _kda_row_at(G, i, BT // 2 - 1)[None, :]              # relative to the chunk's middle
        if tl.max(tl.max(tl.abs(Gm), 1), 0) <= FACTOR_MAX:
            # fast: one reference (the middle token) for every pair. Entries i >= j are exp(G_i - G_j) <= 1
            # as a product of two factors <= exp(FACTOR_MAX); entries i < j may overflow to inf / NaN and
            # are discarded by the select (tl.where) of step 2, never multiplied.
            eP = tl.exp(Gm)
            kn = ks * tl.exp(-Gm)
            akk += tl.dot(ks * eP, tl.trans(kn), input_precision=DOT_PREC)
            aqk += tl.dot(qs * eP, tl.trans(kn), input_precision=DOT_PREC)
        else:
            # safe, off-diagonal blocks: reference G_ref(a) = G at row a*BC - 1 for the rows of sub-chunk a
            Gref = tl.zeros([BT, BK], tl.float32)
            for sa in tl.static_range(1, NB):
                Gref = tl.where(blk[:, None] == sa, _kda_row_at(G, i, sa * BC - 1)[None, :], Gref)
            eR = tl.exp(G - Gref)                                      # row factor, exponent <= 0
            kr_ = ks * eR
            qr_ = qs * eR
            for sa in tl.static_range(1, NB):
                ga = _kda_row_at(G, i, sa * BC - 1)
                # column factor exp(G_ref(a) - G_j) for the columns before sub-chunk a (exponent <= 0)
                kc = ks * tl.exp(tl.where(i[:, None] < sa * BC, ga[None, :] - G, float("-inf")))
                sel = (blk == sa)[:, None]
                akk += tl.where(sel, tl.dot(kr_, tl.trans(kc), input_precision=DOT_PREC), 0.0)
                aqk += tl.where(sel, tl.dot(qr_, tl.trans(kc), input_precision=DOT_PREC), 0.0)
            # safe, diagonal blocks: exact pairwise exp(G_i - G_j), i >= j, BKD channels at a time
            s4 = tl.arange(0, NB)
            r4 = tl.arange(0, BC)
            tri = (r4[:, None] >= r4[None, :])[None, :, :, None]
            eye = (s4[:, None] == s4[None, :])[:, None, :, None]
            for kd0 in tl.static_range(0, BK, BKD):
                cd = k0 + kd0 + tl.arange(0, BKD)
                md = mr[:, None] & (cd[None, :] < K)
                qd = tl.load(q + q_off + cd[None, :], mask=md, other=0.0).to(tl.float32) * rq[:, None]
                kd_ = tl.load(k + q_off + cd[None, :], mask=md, other=0.0).to(tl.float32) * rk[:, None]
                xd_, dd = _kda_load_decay(g, dt_bias, a, lower_bound, g_off + cd[None, :], hv, cd, md, K, GATE,
                                        HAS_DT_BIAS)
                Gd = tl.cumsum(tl.where(md, tl.maximum(dd, -FLOOR), 0.0), 0)
                G4 = tl.reshape(Gd, (NB, BC, BKD))
                q4 = tl.reshape(qd, (NB, BC, BKD))
                k4 = tl.reshape(kd_, (NB, BC, BKD))
                E = tl.exp(tl.where(tri, G4[:, :, None, :] - G4[:, None, :, :], float("-inf")))
                dk4 = tl.sum(k4[:, :, None, :] * k4[:, None, :, :] * E, 3)      # (NB, BC, BC)
                dq4 = tl.sum(q4[:, :, None, :] * k4[:, None, :, :] * E, 3)
                # place block n at rows / columns n*BC ... n*BC + BC - 1 of the BT x BT matrices
                akk += tl.reshape(tl.where(eye, dk4[:, :, None, :], 0.0), (BT, BT))
                aqk += tl.reshape(tl.where(eye, dq4[:, :, None, :], 0.0), (BT, BT))
    # 2. UT transform by block forward substitution
    akk = tl.where(i[:, None] > i[None, :], b[:, None] * akk, 0.0)
    aqk = tl.where(i[:, None] >= i[None, :], aqk, 0.0)
    a_off = (rows * HV + hv)[:, None] * BT + i[None, :]
    tl.store(AQK + a_off, aqk.to(AQK.dtype.element_ty), mask=mr[:, None])
    T = _kda_block_tri_inverse(akk, BT, BC, DOT_PREC)
    # 3. U = T (beta v), W = T (beta exp(G) k)
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        m = mr[:, None] & (vc[None, :] < V)
        vs = tl.load(v + v_off + vc[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.dot(T, b[:, None] * vs, input_precision=DOT_PREC)
        tl.store(U + v_off + vc[None, :], u.to(U.dtype.element_ty), mask=m)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m = mr[:, None] & (cols[None, :] < K)
        ks = tl.load(k + q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
        x_, d = _kda_load_decay(g, dt_bias, a, lower_bound, g_off + cols[None, :], hv, cols, m, K, GATE,
                               HAS_DT_BIAS)
        G = tl.cumsum(tl.where(m, tl.maximum(d, -FLOOR), 0.0), 0)
        w = tl.dot(T, b[:, None] * ks * tl.exp(G), input_precision=DOT_PREC)
        tl.store(W + g_off + cols[None, :], w.to(W.dtype.element_ty), mask=m)
