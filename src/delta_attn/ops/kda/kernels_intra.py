"""Intra-chunk stage of KDA (Triton): per chunk and value head, the operands of the state scan.

Per chunk (parallel over chunks x value heads), with G the chunk-local cumulative log decay
(``kernels_gate.py``) and ``D_ij = diag(exp(G_i - G_j))``:

1. the intra-chunk products ``Akk_ij = beta_i k_i . D_ij . k_j`` (i > j) and ``Aqk_ij = q_i . D_ij . k_j``
   (i >= j), factored as ``exp(G_i - G_ref) exp(G_ref - G_j)`` while every exponent stays in fp32 range,
   else exactly (pairwise per channel; no exponent is ever > 0, -inf decays included); Aqk's diagonal
   (D_ii = 1) as q_i . k_i in fp32 where the factors are rounded to bf16;
2. the UT transform ``T = (I + Akk)^-1``;
3. ``U = T (beta v)``, ``W = T (beta exp(G) k)``, ``qg = exp(G) q``, ``kd = exp(G_last - G) k`` and
   ``exp(G_last)``.

Two kernels, one per use:

* ``_kda_infer_intra_kernel`` (inference prefill, 16- or 32-token chunks): two launches. ``EXACT=False``
  (every chunk) forms the factored products only, with the strong-decay code compiled out, and flags a
  chunk whose cumulative decay exceeds ``FACTOR_MAX``; ``EXACT=True`` returns at once for unflagged chunks
  and redoes the flagged ones pairwise. T by block merging (``_kda_tri_inverse_dots``: the 4x4 diagonal blocks
  exactly, then pairs joined), a few small dots instead of BT dependent substitution steps; T is not stored.
* ``_kda_train_intra_kernel`` (training, 64-token chunks of 4 sub-chunks of 16): factored at the chunk's
  middle token when every |G - G_mid| <= FACTOR_MAX, else off-diagonal 16x16 blocks factored at the
  sub-chunk boundary (both exponents <= 0) and diagonal blocks pairwise; T by block forward substitution,
  stored for the backward. Every chunk, or with ``ONLY_FLAGGED`` only the (chunk, value head) pairs that the
  Gluon kernel of its common domain (``kernels_intra_gluon.py``, factored products only) flagged in FLAGS.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels_gate import (_kda_chunk_decay, _kda_chunk_rows, _kda_cumsum, _kda_floor, _kda_gdiff, _kda_head_gate,
                           _kda_load_decay, _kda_rel, _kda_row_at, _kda_row_norms_sliced)


@triton.jit
def _kda_tri_inverse_dots(A, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for strictly lower-triangular A (BT = 16, 32 or 64) by block merging: the 4x4 diagonal blocks D
    exactly, (I + D)^-1 = (I - D)(I + D^2), then pairs of blocks joined, T <- T - T N T with N the lower-left block
    of each pair (of 4, 8, ... rows): (I + D + N)^-1 = (I - T N) T as (T N)^2 = 0. No power of A beyond a 4x4
    block's square: stable where A's entries are near 1 (correlated keys), unlike the doubling product
    (I - A)(I + A^2)(I + A^4)..., whose terms of size C(BT - 2, BT / 2 - 1) a^(BT / 2) cancel."""
    i = tl.arange(0, BT)
    eye = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    D = tl.where(i[:, None] // 4 == i[None, :] // 4, A, 0.0)
    T = eye - D
    T = T + tl.dot(T, tl.dot(D, D, input_precision=PREC), input_precision=PREC)
    for s in tl.static_range(1, 5):
        if BT >= (4 << s):
            N = tl.where((i[:, None] // (4 << s) == i[None, :] // (4 << s)) &
                         (i[:, None] // (2 << s) != i[None, :] // (2 << s)), A, 0.0)
            T = T - tl.dot(tl.dot(T, N, input_precision=PREC), T, input_precision=PREC)
    return T


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
    for _ in tl.static_range(1, NB):
        X = Dinv - tl.dot(M, X, input_precision=DOT_PREC)
    return X


@triton.jit
def _kda_apply_ut(T, ch, gate, v, k, rk, U, W, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                  GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, FLOOR: tl.constexpr, DOT_PREC: tl.constexpr,
                  TWO_FLOAT: tl.constexpr):
    """The UT transform applied to the chunk ``ch`` (a KdaChunkRows; ``gate`` its head's KdaGate, rk the rows'
    k factors): U = T (beta v) and W = T (beta exp(G) k), V and K slice by slice. Both products take T as it
    leaves the triangular inverse, on fp32 operands (``DOT_PREC``: tf32 for bf16 inputs): T converted to a bf16
    register operand gave O(1) errors on the GPU under Triton 3.6 (property seed 219's W, test_kda_gpu seed 241's
    U; docs/PERFORMANCE.md)."""
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        m = ch.mr[:, None] & (vc[None, :] < V)
        vs = tl.load(v + ch.v_off + vc[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.dot(T, ch.b[:, None] * vs, input_precision=DOT_PREC)
        tl.store(U + ch.v_off + vc[None, :], u.to(U.dtype.element_ty), mask=m)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m = ch.mr[:, None] & (cols[None, :] < K)
        ks = tl.load(k + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
        x_, d, G, Gl_ = _kda_chunk_decay(gate, ch.g_off + cols[None, :], ch.hv, cols, m, K, GATE, HAS_DT_BIAS, FLOOR,
                                         TWO_FLOAT)
        w = tl.dot(T, ch.b[:, None] * ks * tl.exp(G), input_precision=DOT_PREC)
        tl.store(W + ch.g_off + cols[None, :], w.to(W.dtype.element_ty), mask=m)


@triton.jit
def _kda_infer_intra_kernel(q, k, v, g, beta, A_log, dt_bias, chunk_info,
                              W, U, QG, KD, AQK, GC, FLAGS,
                              scale, lower_bound, H, HV,
                              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                              BV: tl.constexpr, KS: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
                              HAS_DT_BIAS: tl.constexpr, FLOOR: tl.constexpr, FACTOR_MAX: tl.constexpr,
                              DOT_PREC: tl.constexpr, EXACT: tl.constexpr, INV_PREC: tl.constexpr,
                              TWO_FLOAT: tl.constexpr, OP: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    if EXACT:
        if tl.load(FLAGS + c * HV + hv) == 0:
            return
    ch = _kda_chunk_rows(chunk_info, beta, c, hv, H, HV, K, V, BT)
    gate = _kda_head_gate(g, dt_bias, A_log, lower_bound, hv, GATE)
    tril = ch.i[:, None] >= ch.i[None, :]
    # 1. row norms of q and k, K slice by K slice (KS = KP: one slice); the scale is folded into rq
    sq = tl.zeros([BT], tl.float32)
    sk = tl.zeros([BT], tl.float32)
    if L2NORM:
        for k0 in range(0, K, KS):
            cols = k0 + tl.arange(0, KS)
            m = ch.mr[:, None] & (cols[None, :] < K)
            qx = tl.load(q + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
            kx = tl.load(k + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32)
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
            m = ch.mr[:, None] & (cols[None, :] < K)
            qs_ = tl.load(q + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rq[:, None]
            ks_ = tl.load(k + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
            xs_, ds_, G, Gl = _kda_chunk_decay(gate, ch.g_off + cols[None, :], hv, cols, m, K, GATE, HAS_DT_BIAS, FLOOR,
                                               TWO_FLOAT)
            G_last = _kda_row_at(G, ch.i, ch.L - 1)
            Gij = _kda_gdiff(G[:, None, :], Gl[:, None, :], G[None, :, :], Gl[None, :, :], TWO_FLOAT)
            E = tl.exp(tl.where(tril[:, :, None], Gij, float("-inf")))
            akk += tl.sum(ks_[:, None, :] * ks_[None, :, :] * E, 2)
            aqk += tl.sum(qs_[:, None, :] * ks_[None, :, :] * E, 2)
            tl.store(QG + ch.g_off + cols[None, :], (qs_ * tl.exp(G)).to(QG.dtype.element_ty), mask=m)
            tl.store(KD + ch.g_off + cols[None, :], (ks_ * tl.exp(-_kda_rel(G, Gl, ch.i, ch.L - 1, TWO_FLOAT)))
                     .to(KD.dtype.element_ty), mask=m)
            tl.store(GC + (c * HV + hv) * K + cols, tl.exp(G_last), mask=cols < K)
    else:
        # 2f. factored products exp(G_i) exp(-G_j), valid when every |G| of the chunk is <= FACTOR_MAX;
        #     otherwise the chunk is flagged (what this launch wrote for it is overwritten by EXACT)
        bad = 0.0
        qk = tl.zeros([BT], tl.float32)     # Aqk's diagonal, D_ii = 1: q_i . k_i in fp32, not the rounded factors
        for k0 in range(0, K, KS):
            cols = k0 + tl.arange(0, KS)
            m = ch.mr[:, None] & (cols[None, :] < K)
            qs = tl.load(q + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rq[:, None]
            ks = tl.load(k + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
            xs_, ds_, G, Gl = _kda_chunk_decay(gate, ch.g_off + cols[None, :], hv, cols, m, K, GATE, HAS_DT_BIAS, FLOOR,
                                               TWO_FLOAT)
            bad = tl.maximum(bad, tl.max(tl.max(tl.abs(G), 1), 0))
            eP = tl.exp(G)
            kn = ks * tl.exp(-G)
            kn = kn.to(OP)
            akk += tl.dot((ks * eP).to(OP), tl.trans(kn), input_precision=DOT_PREC)
            aqk += tl.dot((qs * eP).to(OP), tl.trans(kn), input_precision=DOT_PREC)
            qk += tl.sum(qs * ks, 1)
            G_last = tl.sum(tl.where(ch.i[:, None] == ch.L - 1, G, 0.0), 0)
            tl.store(QG + ch.g_off + cols[None, :], (qs * eP).to(QG.dtype.element_ty), mask=m)
            tl.store(KD + ch.g_off + cols[None, :], (ks * tl.exp(-_kda_rel(G, Gl, ch.i, ch.L - 1, TWO_FLOAT)))
                     .to(KD.dtype.element_ty), mask=m)
            tl.store(GC + (c * HV + hv) * K + cols, tl.exp(G_last), mask=cols < K)
        fast = bad <= FACTOR_MAX
        tl.store(FLAGS + c * HV + hv, tl.where(fast, 0, 1).to(tl.int32))
        if not fast:
            return
        aqk = tl.where(ch.i[:, None] == ch.i[None, :], qk[:, None], aqk)
    # 3. UT transform: T = (I + strictly_lower(beta_i k_i D_ij k_j))^-1; Aqk stored (i >= j)
    akk = tl.where(ch.i[:, None] > ch.i[None, :], ch.b[:, None] * akk, 0.0)
    aqk = tl.where(tril, aqk, 0.0)
    T = _kda_tri_inverse_dots(akk, BT, INV_PREC)
    tl.store(AQK + (ch.rows * HV + hv)[:, None] * BT + ch.i[None, :], aqk.to(AQK.dtype.element_ty), mask=ch.mr[:, None])
    # 4. U = T (beta v), W = T (beta exp(G) k)
    _kda_apply_ut(T, ch, gate, v, k, rk, U, W, K, V, BV, KS, GATE, HAS_DT_BIAS, FLOOR, DOT_PREC, TWO_FLOAT)


@triton.jit
def _kda_train_intra_kernel(q, k, v, g, beta, A_log, dt_bias, chunk_info,
                           W, U, QG, KD, AQK, GC, TM, FLAGS,
                           scale, lower_bound, H, HV,
                           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                           BK: tl.constexpr, BKD: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                           GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, FLOOR: tl.constexpr,
                           FACTOR_MAX: tl.constexpr, DOT_PREC: tl.constexpr, INV_PREC: tl.constexpr,
                           TWO_FLOAT: tl.constexpr, OP: tl.constexpr, ONLY_FLAGGED: tl.constexpr):
    NB: tl.constexpr = BT // BC
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    if ONLY_FLAGGED:        # after the Gluon kernel: only the pairs it flagged (FLAGS read only here)
        if tl.load(FLAGS + c * HV + hv) == 0:
            return
    ch = _kda_chunk_rows(chunk_info, beta, c, hv, H, HV, K, V, BT)
    gate = _kda_head_gate(g, dt_bias, A_log, lower_bound, hv, GATE)
    blk = ch.i // BC                                # sub-chunk of each row
    # 0. row factors: q_used = rq * q (scale folded in), k_used = rk * k
    nq, rk = _kda_row_norms_sliced(q, k, ch.q_off, ch.mr, K, BT, BK, L2NORM)
    rq = nq * scale
    # 1. per K slice: decays, output operands, intra-chunk products
    akk = tl.zeros([BT, BT], tl.float32)
    aqk = tl.zeros([BT, BT], tl.float32)
    qk = tl.zeros([BT], tl.float32)     # Aqk's diagonal, D_ii = 1: q_i . k_i in fp32, not the rounded factors
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        m = ch.mr[:, None] & (cols[None, :] < K)
        qs = tl.load(q + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rq[:, None]
        ks = tl.load(k + ch.q_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * rk[:, None]
        qk += tl.sum(qs * ks, 1)
        x_, d, G, Gl = _kda_chunk_decay(gate, ch.g_off + cols[None, :], hv, cols, m, K, GATE, HAS_DT_BIAS, FLOOR,
                                        TWO_FLOAT)     # chunk-local, <= 0, finite
        G_last = _kda_row_at(G, ch.i, ch.L - 1)
        tl.store(QG + ch.g_off + cols[None, :], (qs * tl.exp(G)).to(QG.dtype.element_ty), mask=m)
        tl.store(KD + ch.g_off + cols[None, :], (ks * tl.exp(-_kda_rel(G, Gl, ch.i, ch.L - 1, TWO_FLOAT)))
                 .to(KD.dtype.element_ty), mask=m)
        tl.store(GC + (c * HV + hv) * K + cols, tl.exp(G_last), mask=cols < K)
        Gm = _kda_rel(G, Gl, ch.i, BT // 2 - 1, TWO_FLOAT)            # relative to the chunk's middle
        if tl.max(tl.max(tl.abs(Gm), 1), 0) <= FACTOR_MAX:
            # fast: one reference (the middle token) for every pair. Entries i >= j are exp(G_i - G_j) <= 1
            # as a product of two factors <= exp(FACTOR_MAX); entries i < j may overflow to inf / NaN and
            # are discarded by the select (tl.where) of step 2, never multiplied.
            eP = tl.exp(Gm)
            kn = (ks * tl.exp(-Gm)).to(OP)
            akk += tl.dot((ks * eP).to(OP), tl.trans(kn), input_precision=DOT_PREC)
            aqk += tl.dot((qs * eP).to(OP), tl.trans(kn), input_precision=DOT_PREC)
        else:
            # safe, off-diagonal blocks: reference G_ref(a) = G at row a*BC - 1 for the rows of sub-chunk a
            # (runtime loops in this rare branch, not unrolled: seconds less of compile time)
            Gr = G                                                     # G - G_ref (G_ref = 0 for sub-chunk 0)
            for sa in range(1, NB):
                Gr = tl.where(blk[:, None] == sa, _kda_rel(G, Gl, ch.i, sa * BC - 1, TWO_FLOAT), Gr)
            eR = tl.exp(Gr)                                            # row factor, exponent <= 0
            kr_ = (ks * eR).to(OP)
            qr_ = (qs * eR).to(OP)
            for sa in range(1, NB):
                # column factor exp(G_ref(a) - G_j) for the columns before sub-chunk a (exponent <= 0)
                gaj = -_kda_rel(G, Gl, ch.i, sa * BC - 1, TWO_FLOAT)
                kc = (ks * tl.exp(tl.where(ch.i[:, None] < sa * BC, gaj, float("-inf")))).to(OP)
                sel = (blk == sa)[:, None]
                akk += tl.where(sel, tl.dot(kr_, tl.trans(kc), input_precision=DOT_PREC), 0.0)
                aqk += tl.where(sel, tl.dot(qr_, tl.trans(kc), input_precision=DOT_PREC), 0.0)
            # safe, diagonal blocks: exact pairwise exp(G_i - G_j), i >= j, BKD channels at a time
            s4 = tl.arange(0, NB)
            r4 = tl.arange(0, BC)
            tri = (r4[:, None] >= r4[None, :])[None, :, :, None]
            eye = (s4[:, None] == s4[None, :])[:, None, :, None]
            for kd0 in range(0, BK, BKD):
                cd = k0 + kd0 + tl.arange(0, BKD)
                md = ch.mr[:, None] & (cd[None, :] < K)
                qd = tl.load(q + ch.q_off + cd[None, :], mask=md, other=0.0).to(tl.float32) * rq[:, None]
                kd_ = tl.load(k + ch.q_off + cd[None, :], mask=md, other=0.0).to(tl.float32) * rk[:, None]
                xd_, dd = _kda_load_decay(gate, ch.g_off + cd[None, :], hv, cd, md, K, GATE, HAS_DT_BIAS)
                Gd, Ld = _kda_cumsum(tl.where(md, _kda_floor(dd, FLOOR), 0.0), FLOOR, TWO_FLOAT)
                G4 = tl.reshape(Gd, (NB, BC, BKD))
                L4 = tl.reshape(Ld, (NB, BC, BKD))
                q4 = tl.reshape(qd, (NB, BC, BKD))
                k4 = tl.reshape(kd_, (NB, BC, BKD))
                Gij = _kda_gdiff(G4[:, :, None, :], L4[:, :, None, :], G4[:, None, :, :], L4[:, None, :, :], TWO_FLOAT)
                E = tl.exp(tl.where(tri, Gij, float("-inf")))
                dk4 = tl.sum(k4[:, :, None, :] * k4[:, None, :, :] * E, 3)      # (NB, BC, BC)
                dq4 = tl.sum(q4[:, :, None, :] * k4[:, None, :, :] * E, 3)
                # place block n at rows / columns n*BC ... n*BC + BC - 1 of the BT x BT matrices
                akk += tl.reshape(tl.where(eye, dk4[:, :, None, :], 0.0), (BT, BT))
                aqk += tl.reshape(tl.where(eye, dq4[:, :, None, :], 0.0), (BT, BT))
    # 2. UT transform by block forward substitution
    akk = tl.where(ch.i[:, None] > ch.i[None, :], ch.b[:, None] * akk, 0.0)
    aqk = tl.where(ch.i[:, None] > ch.i[None, :], aqk, tl.where(ch.i[:, None] == ch.i[None, :], qk[:, None], 0.0))
    a_off = (ch.rows * HV + hv)[:, None] * BT + ch.i[None, :]
    tl.store(AQK + a_off, aqk.to(AQK.dtype.element_ty), mask=ch.mr[:, None])
    T = _kda_block_tri_inverse(akk, BT, BC, INV_PREC)
    tl.store(TM + a_off, T, mask=ch.mr[:, None])       # kept for the backward
    # 3. U = T (beta v), W = T (beta exp(G) k)
    _kda_apply_ut(T, ch, gate, v, k, rk, U, W, K, V, BV, BK, GATE, HAS_DT_BIAS, FLOOR, DOT_PREC, TWO_FLOAT)
