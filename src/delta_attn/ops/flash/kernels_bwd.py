"""Triton backward kernels of flash attention (FlashAttention-2 algorithm), in three passes:

1. ``_flash_bwd_preprocess_kernel``: delta_i = sum_d dO_id * O_id (fp32, the layout of lse);
2. ``_flash_bwd_dkdv_kernel``: one program owns a key block of one key head and loops over every
   query head of its GQA group and every visible query block, so dK and dV are summed over the
   group in registers: no atomics;
3. ``_flash_bwd_dq_kernel``: one program owns a query block and loops over the visible key blocks.

No pass uses atomics, so the gradients are bit-identical from run to run whatever
``deterministic`` says. Probabilities are recomputed from the saved lse
(``p = exp2(s2 - lse * log2 e)``), the dropout mask is regenerated from the Philox stream of the
forward, and softcap's derivative ``1 - tanh^2`` is applied to dS.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels_fwd import _dropout_keep, _head_terms, _key_blocks, _score_scales, _scores, _seq_bounds


@triton.jit
def _flash_bwd_preprocess_kernel(
        O, DO, DELTA, CU_Q, stride_ob, stride_ot, stride_oh, stride_dob, stride_dot, stride_doh,
        stride_lb, stride_lh, stride_lt, seqlen_q, n_heads,
        IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_bh = tl.program_id(1)
    pid_b = pid_bh // n_heads
    pid_h = pid_bh % n_heads
    q_start, _ks, sq, _sk = _seq_bounds(CU_Q, CU_Q, pid_b, seqlen_q, seqlen_q, IS_VARLEN)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 >= sq:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < sq) & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + offs_m[:, None].to(tl.int64))
    o = tl.load(O + pid_b.to(tl.int64) * stride_ob + pid_h.to(tl.int64) * stride_oh + rows * stride_ot
                + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + pid_b.to(tl.int64) * stride_dob + pid_h.to(tl.int64) * stride_doh + rows * stride_dot
                 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    l_base = DELTA + pid_b.to(tl.int64) * stride_lb + pid_h.to(tl.int64) * stride_lh + q_start * stride_lt
    tl.store(l_base + offs_m.to(tl.int64) * stride_lt, delta, mask=offs_m < sq)


@triton.jit
def _query_blocks(n0, seqlen_q, seqlen_k, wl, wr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query-block bounds for the keys [n0, n0 + BLOCK_N): [lo, fs) and [fe, hi) need masks,
    [fs, fe) are fully visible and inside [0, Sq). Rows past Sq need no score mask (their lse is +inf,
    so p = 0). A key block that ends past Sk takes the masked copy for every query block, which sets
    p = 0 for its keys past Sk (their zero-loaded score can sit far above a row's lse: see _dq_inner)."""
    off = seqlen_k - seqlen_q
    n_last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo = 0
    hi = seqlen_q
    fs = 0
    fe_bound = seqlen_q          # the last partial row block goes to the masked copy (load masks)
    if HAS_WR:
        lo = tl.maximum(n0 - off - wr, 0)
        fs = tl.cdiv(n_last - off - wr, BLOCK_M) * BLOCK_M
    if HAS_WL:
        hi = tl.minimum(n_last - off + wl + 1, seqlen_q)
        fe_bound = tl.minimum(n0 - off + wl + 1, seqlen_q)
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.maximum(tl.cdiv(hi, BLOCK_M) * BLOCK_M, lo)
    fs = tl.minimum(tl.maximum(fs, lo), hi)
    fe = tl.maximum(tl.minimum((fe_bound // BLOCK_M) * BLOCK_M, hi), fs)
    if n0 + BLOCK_N > seqlen_k:     # the sequence's last, partial key block: no unmasked query block
        fs = hi
        fe = hi
    return lo, fs, fe, hi


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qt, stride_dot, stride_lt,
                offs_n, offs_d, start, end, seqlen_q, seqlen_k, diag_off, slope2, wl, wr, qk_mult, cap_in,
                seed_bh, rng_stride, dropout_p,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                MASKED: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
                EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    offs_mb = tl.arange(0, BLOCK_M)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + offs_mb
        rows = offs_m.to(tl.int64)
        q_ptr = q_base + rows[None, :] * stride_qt + offs_d[:, None]      # q^T (D x BLOCK_M)
        do_ptr = do_base + rows[:, None] * stride_dot + offs_d[None, :]
        # the tile is computed transposed (keys x queries); unmasked blocks need no load mask
        if MASKED or not EVEN_D:
            row_ok = offs_m < seqlen_q
            d_ok = offs_d < HEAD_DIM
            q_t = tl.load(q_ptr, mask=row_ok[None, :] & d_ok[:, None], other=0.0)
            do = tl.load(do_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            lse2 = tl.load(l_base + rows * stride_lt, mask=row_ok, other=float("inf")) * 1.4426950408889634
            delta = tl.load(d_base + rows * stride_lt, mask=row_ok, other=0.0)
        else:
            q_t = tl.load(q_ptr)
            do = tl.load(do_ptr)
            lse2 = tl.load(l_base + rows * stride_lt) * 1.4426950408889634
            delta = tl.load(d_base + rows * stride_lt)
        # 1. P^T of this tile, recomputed from lse; keys past Sk (masked copy only) get p = 0
        qk_t = tl.dot(k, q_t)
        s_t, t_t = _scores(qk_t, offs_m[None, :], offs_n[:, None], diag_off, slope2, wl, wr, seqlen_k, qk_mult,
                           cap_in, SOFTCAP, HAS_ALIBI, MASKED, HAS_WL, HAS_WR, True)
        p_t = tl.exp2(s_t - lse2[None, :])
        # 2. dV += P_dropped^T dO
        if HAS_DROPOUT:
            keep_t = _dropout_keep(seed_bh, offs_m[None, :], offs_n[:, None], rng_stride, dropout_p)
            pd_t = tl.where(keep_t, p_t / (1.0 - dropout_p), 0.0)
        else:
            pd_t = p_t
        dv = tl.dot(pd_t.to(do.dtype), do, dv)
        # 3. dP^T = V dO^T (through the dropout mask), dS = P (dP - delta), softcap' = 1 - tanh^2
        dp_t = tl.dot(v, tl.trans(do))
        if HAS_DROPOUT:
            dp_t = tl.where(keep_t, dp_t / (1.0 - dropout_p), 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        # 4. dK += dS^T Q (the softmax scale is applied once at the end)
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk)
    return dk, dv


@triton.jit
def _flash_bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, ALIBI, SEED,
        stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
        stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
        stride_lb, stride_lh, stride_lt, stride_ab, stride_ah,
        seqlen_q, seqlen_k, rng_stride, n_heads, n_kv_heads, group, scale, softcap, wl, wr, dropout_p,
        SQ_BUCKET, SK_BUCKET,
        IS_VARLEN: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
        HAS_DROPOUT: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_N keys of one (sequence, key head). Grid (n blocks, B * Hk)."""
    pid_bh = tl.program_id(1)
    pid_b = pid_bh // n_kv_heads
    pid_hk = pid_bh % n_kv_heads
    q_start, k_start, sq, sk = _seq_bounds(CU_Q, CU_K, pid_b, seqlen_q, seqlen_k, IS_VARLEN)
    n0 = tl.program_id(0) * BLOCK_N
    if n0 >= sk:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    kv_mask = offs_n[:, None] < sk
    if not EVEN_D:
        kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
    cols = offs_n[:, None].to(tl.int64)
    k = tl.load(K + pid_b.to(tl.int64) * stride_kb + pid_hk.to(tl.int64) * stride_kh
                + (k_start + cols) * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + pid_b.to(tl.int64) * stride_vb + pid_hk.to(tl.int64) * stride_vh
                + (k_start + cols) * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    qk_mult, cap_in = _score_scales(scale, softcap, SOFTCAP)
    diag_off = sk - sq
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    lo, fs, fe, hi = _query_blocks(n0, sq, sk, wl, wr, HAS_WL, HAS_WR, BLOCK_M, BLOCK_N)
    # GQA: the query heads of this key head's group, summed in registers
    for g in range(0, group):
        h = pid_hk * group + g
        q_base = Q + pid_b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start * stride_qt
        do_base = DO + pid_b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + q_start * stride_dot
        l_off = pid_b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start * stride_lt
        slope2, seed_bh = _head_terms(ALIBI, stride_ab, stride_ah, SEED, pid_b, h, pid_b * n_heads + h,
                                      HAS_ALIBI, HAS_DROPOUT)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + l_off, DELTA + l_off, stride_qt, stride_dot,
                             stride_lt, offs_n, offs_d, lo, fs, sq, sk, diag_off, slope2, wl, wr, qk_mult, cap_in,
                             seed_bh, rng_stride, dropout_p, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, True,
                             HAS_WL, HAS_WR, EVEN_D, HEAD_DIM, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + l_off, DELTA + l_off, stride_qt, stride_dot,
                             stride_lt, offs_n, offs_d, fs, fe, sq, sk, diag_off, slope2, wl, wr, qk_mult, cap_in,
                             seed_bh, rng_stride, dropout_p, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, False,
                             HAS_WL, HAS_WR, EVEN_D, HEAD_DIM, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + l_off, DELTA + l_off, stride_qt, stride_dot,
                             stride_lt, offs_n, offs_d, fe, hi, sq, sk, diag_off, slope2, wl, wr, qk_mult, cap_in,
                             seed_bh, rng_stride, dropout_p, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, True,
                             HAS_WL, HAS_WR, EVEN_D, HEAD_DIM, BLOCK_M)
    dk = dk * scale
    tl.store(DK + pid_b.to(tl.int64) * stride_dkb + pid_hk.to(tl.int64) * stride_dkh + (k_start + cols) * stride_dkt
             + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + pid_b.to(tl.int64) * stride_dvb + pid_hk.to(tl.int64) * stride_dvh + (k_start + cols) * stride_dvt
             + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, start, end,
              seqlen_k, diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p,
              SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              MASKED: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
              EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_nb = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_nb
        kv_mask = offs_n[:, None] < seqlen_k
        if not EVEN_D:
            kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
        cols = offs_n[:, None].to(tl.int64)
        if MASKED or not EVEN_D:
            kv_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_base + cols * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + cols * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_base + cols * stride_kt + offs_d[None, :])
            v = tl.load(v_base + cols * stride_vt + offs_d[None, :])
        # 1. P recomputed from lse. Keys past Sk (only in masked blocks) get s = -inf, so p = 0: they
        # load as zero, but their raw score 0 (or the ALiBi term alone) can sit far above a row's lse,
        # and the huge p there made dS = P (dP - delta) overflow fp16 before dS K, with inf * 0 = NaN
        qk = tl.dot(q, tl.trans(k))
        s, t = _scores(qk, offs_m[:, None], offs_n[None, :], diag_off, slope2, wl, wr, seqlen_k, qk_mult, cap_in,
                       SOFTCAP, HAS_ALIBI, MASKED, HAS_WL, HAS_WR, True)
        p = tl.exp2(s - lse2[:, None])
        # 2. dS = P (dP - delta), dP through the dropout mask
        dp = tl.dot(do, tl.trans(v))
        if HAS_DROPOUT:
            keep = _dropout_keep(seed_bh, offs_m[:, None], offs_n[None, :], rng_stride, dropout_p)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        # 3. dQ += dS K
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _flash_bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, ALIBI, SEED,
        stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
        stride_dqb, stride_dqt, stride_dqh, stride_lb, stride_lh, stride_lt, stride_ab, stride_ah,
        seqlen_q, seqlen_k, rng_stride, n_heads, group, scale, softcap, wl, wr, dropout_p,
        SQ_BUCKET, SK_BUCKET,
        IS_VARLEN: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
        HAS_DROPOUT: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, REVERSE_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_M query rows of one (sequence, query head). Grid (m blocks, B * Hq)."""
    pid_bh = tl.program_id(1)
    pid_b = pid_bh // n_heads
    pid_h = pid_bh % n_heads
    q_start, k_start, sq, sk = _seq_bounds(CU_Q, CU_K, pid_b, seqlen_q, seqlen_k, IS_VARLEN)
    pid_m = tl.program_id(0)
    if REVERSE_M:
        pid_m = tl.num_programs(0) - 1 - pid_m
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    kv_h = (pid_h // group).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    row_ok = offs_m < sq
    q_mask = row_ok[:, None]
    if not EVEN_D:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    rows = offs_m[:, None].to(tl.int64)
    q = tl.load(Q + pid_b.to(tl.int64) * stride_qb + pid_h.to(tl.int64) * stride_qh + (q_start + rows) * stride_qt
                + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + pid_b.to(tl.int64) * stride_dob + pid_h.to(tl.int64) * stride_doh
                 + (q_start + rows) * stride_dot + offs_d[None, :], mask=q_mask, other=0.0)
    l_off = (pid_b.to(tl.int64) * stride_lb + pid_h.to(tl.int64) * stride_lh
             + (q_start + offs_m.to(tl.int64)) * stride_lt)
    lse2 = tl.load(LSE + l_off, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + l_off, mask=row_ok, other=0.0)
    k_base = K + pid_b.to(tl.int64) * stride_kb + kv_h * stride_kh + k_start * stride_kt
    v_base = V + pid_b.to(tl.int64) * stride_vb + kv_h * stride_vh + k_start * stride_vt
    qk_mult, cap_in = _score_scales(scale, softcap, SOFTCAP)
    slope2, seed_bh = _head_terms(ALIBI, stride_ab, stride_ah, SEED, pid_b, pid_h, pid_bh, HAS_ALIBI, HAS_DROPOUT)
    diag_off = sk - sq
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo, fs, fe, hi = _key_blocks(m0, sq, sk, wl, wr, HAS_WL, HAS_WR, BLOCK_M, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, lo, fs, sk,
                   diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p, SOFTCAP, HAS_ALIBI,
                   HAS_DROPOUT, True, HAS_WL, HAS_WR, EVEN_D, HEAD_DIM, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, fs, fe, sk,
                   diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p, SOFTCAP, HAS_ALIBI,
                   HAS_DROPOUT, False, HAS_WL, HAS_WR, EVEN_D, HEAD_DIM, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, fe, hi, sk,
                   diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p, SOFTCAP, HAS_ALIBI,
                   HAS_DROPOUT, True, HAS_WL, HAS_WR, EVEN_D, HEAD_DIM, BLOCK_N)
    dq = dq * scale
    tl.store(DQ + pid_b.to(tl.int64) * stride_dqb + pid_h.to(tl.int64) * stride_dqh + (q_start + rows) * stride_dqt
             + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=q_mask)
