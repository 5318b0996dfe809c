"""Triton forward kernel of flash attention (FlashAttention-2 algorithm) and the helpers shared with
the backward kernels.

Conventions used by every kernel of this package:
- a tensor is addressed through four strides (batch, token, head, dim); a packed (varlen) batch has
  batch stride 0 and per-sequence token offsets read from ``cu_seqlens`` (the "thd" and "htd"
  layouts differ only in their strides, so neither is copied);
- scores live in the log2 domain: ``s2 = log2(e) * score``, with the softmax scale (and, for
  softcap, ``log2(e) * softcap``) folded into one multiplier, so the softmax uses ``exp2``;
- query i sees key j when ``i + off - wl <= j <= i + off + wr`` with ``off = Sk - Sq``
  (bottom-right alignment); a key block that every query of a row block sees is processed by a
  copy of the loop compiled without any mask (``MASKED=False``), the diagonal/edge blocks by a copy
  with masks;
- dropout: a counter-based Philox stream; key = (seed, batch * Hq + head), counter =
  i * max_seqlen_k + j, so the backward regenerates exactly the forward's mask.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); exact limits +-1 for large |x|
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _visible(i2, j2, diag_off, wl, wr, seqlen_k, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
             MASK_K: tl.constexpr):
    """Query i2 may see key j2: i + off - wl <= j <= i + off + wr (and j < Sk when MASK_K)."""
    rel = i2 + diag_off - j2                   # i + Sk - Sq - j
    vis = j2 >= 0
    if MASK_K:
        vis = vis & (j2 < seqlen_k)
    if HAS_WL:
        vis = vis & (rel <= wl)
    if HAS_WR:
        vis = vis & (-rel <= wr)
    return vis


@triton.jit
def _scores(qk, i2, j2, diag_off, slope2, wl, wr, seqlen_k, qk_mult, cap_in,
            SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASKED: tl.constexpr,
            HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, MASK_K: tl.constexpr):
    """Raw q.k (fp32) -> log2-domain scores, -inf where masked. ``i2`` / ``j2`` are the query /
    key indices broadcastable to the tile (either orientation). Also returns softcap's tanh (or 0)."""
    if SOFTCAP:
        t = _tanh(qk * cap_in)                 # cap_in = scale / softcap
        s = t * qk_mult                        # qk_mult = softcap * log2(e)
    else:
        t = 0.0
        s = qk * qk_mult                       # qk_mult = scale * log2(e)
    if HAS_ALIBI:
        s -= slope2 * tl.abs(i2 + diag_off - j2).to(tl.float32)
    if MASKED:
        s = tl.where(_visible(i2, j2, diag_off, wl, wr, seqlen_k, HAS_WL, HAS_WR, MASK_K), s, float("-inf"))
    return s, t


@triton.jit
def _dropout_keep(seed_bh, i2, j2, rng_stride, dropout_p):
    """Boolean keep-mask of a tile (query index i2, key index j2, broadcastable): Philox uniform >= p."""
    counter = i2 * rng_stride + j2
    return tl.rand(seed_bh, counter) >= dropout_p


@triton.jit
def _score_scales(scale, softcap, SOFTCAP: tl.constexpr):
    """(qk_mult, cap_in): raw q.k -> log2-domain scores is ``qk * qk_mult``, or with softcap
    ``tanh(qk * cap_in) * qk_mult`` (see ``_scores``)."""
    if SOFTCAP:
        qk_mult = softcap * 1.4426950408889634
        cap_in = scale / softcap
    else:
        qk_mult = scale * 1.4426950408889634
        cap_in = 0.0
    return qk_mult, cap_in


@triton.jit
def _head_terms(ALIBI, stride_ab, stride_ah, SEED, b, h, bh, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """Per (sequence b, query head h, flat index bh = b * Hq + h): the ALIBI slope in the log2 domain and
    the dropout stream's key (0 when unused)."""
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b * stride_ab + h * stride_ah).to(tl.float32) * 1.4426950408889634
    seed_bh = 0
    if HAS_DROPOUT:
        seed_bh = tl.load(SEED).to(tl.int64) + bh.to(tl.int64) * 4294967296
    return slope2, seed_bh


@triton.jit
def _key_blocks(m0, seqlen_q, seqlen_k, wl, wr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key-block bounds for the query rows [m0, m0 + BLOCK_M): blocks in [lo, fs) and [fe, hi)
    need masks, blocks in [fs, fe) are fully visible to every real row."""
    off = seqlen_k - seqlen_q
    m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    fs = 0
    fe_bound = seqlen_k
    if HAS_WL:
        lo = tl.maximum(m0 + off - wl, 0)
        fs = tl.cdiv(m_last + off - wl, BLOCK_N) * BLOCK_N
    if HAS_WR:
        hi = tl.minimum(m_last + off + wr + 1, seqlen_k)
        fe_bound = tl.minimum(m0 + off + wr + 1, seqlen_k)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(tl.cdiv(hi, BLOCK_N) * BLOCK_N, lo)
    fs = tl.minimum(tl.maximum(fs, lo), hi)
    fe = tl.maximum(tl.minimum((fe_bound // BLOCK_N) * BLOCK_N, hi), fs)
    return lo, fs, fe, hi


@triton.jit
def _seq_bounds(cu_q, cu_k, pid_b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(first token of q, of k, Sq, Sk) of sequence pid_b."""
    if IS_VARLEN:
        q_start = tl.load(cu_q + pid_b).to(tl.int64)
        k_start = tl.load(cu_k + pid_b).to(tl.int64)
        sq = (tl.load(cu_q + pid_b + 1) - tl.load(cu_q + pid_b)).to(tl.int32)
        sk = (tl.load(cu_k + pid_b + 1) - tl.load(cu_k + pid_b)).to(tl.int32)
    else:
        q_start = tl.zeros((), dtype=tl.int64)
        k_start = tl.zeros((), dtype=tl.int64)
        sq = seqlen_q
        sk = seqlen_k
    return q_start, k_start, sq, sk


@triton.jit
def _load_kv(src, n0, offs_nb, offs_d, seqlen_k, stride_t, USE_TMA: tl.constexpr, MASKED: tl.constexpr,
             EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One (BLOCK_N, BLOCK_D) block of K or V starting at key n0 (blocks of the unmasked range lie
    inside [0, Sk): no load mask; TMA descriptors zero-fill past the sequence and the head dim)."""
    if USE_TMA:
        x = src.load([n0, 0])
    else:
        offs_n = n0 + offs_nb
        ptrs = src + offs_n[:, None].to(tl.int64) * stride_t + offs_d[None, :]
        if MASKED or not EVEN_D:
            x = tl.load(ptrs, mask=(offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _online_softmax(qk, m_i, l_i, offs_m, offs_n, seqlen_k, diag_off, slope2, wl, wr, qk_mult, cap_in,
                    seed_bh, rng_stride, dropout_p, PLAIN: tl.constexpr, SOFTCAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, MASKED: tl.constexpr,
                    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """One key block of the online softmax: raw scores qk -> (P for the P.V product (dropout
    applied), new running max, new normaliser, the accumulator's rescale factor alpha)."""
    # new running max (0 for rows that saw nothing yet, to avoid inf - inf)
    if PLAIN:
        # no softcap / ALiBi and scale > 0: max on the raw scores, scale folded into one FMA
        if MASKED:
            qk = tl.where(_visible(offs_m[:, None], offs_n[None, :], diag_off, wl, wr, seqlen_k,
                                   HAS_WL, HAS_WR, True), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_mult)
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(qk * qk_mult - m_use[:, None])
    else:
        s, _t = _scores(qk, offs_m[:, None], offs_n[None, :], diag_off, slope2, wl, wr, seqlen_k, qk_mult,
                        cap_in, SOFTCAP, HAS_ALIBI, MASKED, HAS_WL, HAS_WR, True)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    # dropout acts on the probabilities after the normaliser has counted them
    if HAS_DROPOUT:
        p = tl.where(_dropout_keep(seed_bh, offs_m[:, None], offs_n[None, :], rng_stride, dropout_p), p, 0.0)
    return p, m_new, l_i, alpha


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_src, v_src, stride_kt, stride_vt, offs_m, offs_d, start, end,
               seqlen_k, diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p,
               USE_TMA: tl.constexpr, PLAIN: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, MASKED: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
               EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr):
    """Key blocks [start, end): scores, online softmax, P.V, one block after the other."""
    offs_nb = tl.arange(0, BLOCK_N)
    for n0 in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        offs_n = n0 + offs_nb
        k = _load_kv(k_src, n0, offs_nb, offs_d, seqlen_k, stride_kt, USE_TMA, MASKED, EVEN_D, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k))
        p, m_i, l_i, alpha = _online_softmax(qk, m_i, l_i, offs_m, offs_n, seqlen_k, diag_off, slope2, wl, wr,
                                             qk_mult, cap_in, seed_bh, rng_stride, dropout_p, PLAIN, SOFTCAP,
                                             HAS_ALIBI, HAS_DROPOUT, MASKED, HAS_WL, HAS_WR)
        v = _load_kv(v_src, n0, offs_nb, offs_d, seqlen_k, stride_vt, USE_TMA, MASKED, EVEN_D, HEAD_DIM)
        # rescale the accumulator and add P V (accumulated in the MMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit
def _fwd_inner_pipe(acc, m_i, l_i, p_bits, alpha, q, k_src, v_src, stride_kt, stride_vt, offs_m, offs_d, start,
                    end, seqlen_k, diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p,
                    USE_TMA: tl.constexpr, PLAIN: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                    HAS_DROPOUT: tl.constexpr, MASKED: tl.constexpr, HAS_WL: tl.constexpr,
                    HAS_WR: tl.constexpr, EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                    WS: tl.constexpr):
    """Key blocks [start, end), software-pipelined by one block (FA3's intra-warpgroup overlap):
    iteration j computes S_j = Q K_j^T, then issues acc = acc * alpha_{j-1} + P_{j-1} V_{j-1}
    asynchronously and computes the softmax of S_j while that product runs on the tensor cores
    (the compiler waits for it only at the next iteration's S). ``p_bits`` / ``alpha`` carry P_{j-1}
    (of key block start - BLOCK_N, as raw 16-bit patterns so that it stays in registers as the
    MMA's A operand) and its rescale factor in, and those of the last block out."""
    offs_nb = tl.arange(0, BLOCK_N)
    for n0 in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        offs_n = n0 + offs_nb
        k = _load_kv(k_src, n0, offs_nb, offs_d, seqlen_k, stride_kt, USE_TMA, MASKED, EVEN_D, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k))
        v = _load_kv(v_src, n0 - BLOCK_N, offs_nb, offs_d, seqlen_k, stride_vt, USE_TMA, MASKED, EVEN_D,
                     HEAD_DIM)
        acc = tl.dot(p_bits.to(v.dtype, bitcast=True), v, acc * alpha[:, None])
        p, m_i, l_i, alpha = _online_softmax(qk, m_i, l_i, offs_m, offs_n, seqlen_k, diag_off, slope2, wl,
                                             wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p, PLAIN,
                                             SOFTCAP, HAS_ALIBI, HAS_DROPOUT, MASKED, HAS_WL, HAS_WR)
        p_bits = p.to(v.dtype).to(p_bits.dtype, bitcast=True)
    return acc, m_i, l_i, p_bits, alpha


@triton.jit
def _flash_fwd_kernel(
        Q, K, V, O, LSE, CU_Q, CU_K, ALIBI, SEED,
        stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
        stride_lb, stride_lh, stride_lt, stride_ab, stride_ah,
        seqlen_q, seqlen_k, rng_stride, n_heads, group, scale, softcap, wl, wr, dropout_p,
        SQ_BUCKET, SK_BUCKET,
        IS_VARLEN: tl.constexpr, PLAIN: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
        HAS_DROPOUT: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, REVERSE_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        TMA_OK: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr, PIPE: tl.constexpr):
    """One program: BLOCK_M query rows of one (sequence, query head). Grid (m blocks, B * Hq)."""
    pid_bh = tl.program_id(1)
    pid_b = pid_bh // n_heads
    pid_h = pid_bh % n_heads
    q_start, k_start, sq, sk = _seq_bounds(CU_Q, CU_K, pid_b, seqlen_q, seqlen_k, IS_VARLEN)
    pid_m = tl.program_id(0)
    if REVERSE_M:   # causal: the longest rows first, so the last wave is short
        pid_m = tl.num_programs(0) - 1 - pid_m
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    kv_h = (pid_h // group).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    q_mask = offs_m[:, None] < sq
    if not EVEN_D:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q_base = Q + pid_b.to(tl.int64) * stride_qb + pid_h.to(tl.int64) * stride_qh + q_start * stride_qt
    q = tl.load(q_base + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
    k_base = K + pid_b.to(tl.int64) * stride_kb + kv_h * stride_kh + k_start * stride_kt
    v_base = V + pid_b.to(tl.int64) * stride_vb + kv_h * stride_vh + k_start * stride_vt
    TMA: tl.constexpr = USE_TMA and TMA_OK
    if TMA:   # per-sequence TMA descriptors (rows past Sk and columns past D read as zero)
        k_src = tl.make_tensor_descriptor(k_base, shape=[sk, HEAD_DIM], strides=[stride_kt, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, shape=[sk, HEAD_DIM], strides=[stride_vt, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_src = k_base
        v_src = v_base

    qk_mult, cap_in = _score_scales(scale, softcap, SOFTCAP)
    slope2, seed_bh = _head_terms(ALIBI, stride_ab, stride_ah, SEED, pid_b, pid_h, pid_bh, HAS_ALIBI, HAS_DROPOUT)
    diag_off = sk - sq

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo, fs, fe, hi = _key_blocks(m0, sq, sk, wl, wr, HAS_WL, HAS_WR, BLOCK_M, BLOCK_N)
    if PIPE:
        # software-pipelined loop (see _fwd_inner_pipe): the first block's scores and softmax
        # are peeled off, the last block's P.V closes the pipeline
        p_bits = tl.zeros((BLOCK_M, BLOCK_N), tl.int16)
        alpha = tl.zeros((BLOCK_M,), tl.float32)
        offs_nb = tl.arange(0, BLOCK_N)
        if hi > lo:
            k = _load_kv(k_src, lo, offs_nb, offs_d, sk, stride_kt, TMA, True, EVEN_D, HEAD_DIM)
            p, m_i, l_i, alpha = _online_softmax(tl.dot(q, tl.trans(k)), m_i, l_i, offs_m, lo + offs_nb, sk,
                                                 diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride,
                                                 dropout_p, PLAIN, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, True, HAS_WL,
                                                 HAS_WR)
            p_bits = p.to(Q.dtype.element_ty).to(tl.int16, bitcast=True)
        n1 = lo + BLOCK_N
        acc, m_i, l_i, p_bits, alpha = _fwd_inner_pipe(
            acc, m_i, l_i, p_bits, alpha, q, k_src, v_src, stride_kt, stride_vt, offs_m, offs_d, n1, fs, sk, diag_off,
            slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p, TMA, PLAIN, SOFTCAP, HAS_ALIBI,
            HAS_DROPOUT, True, HAS_WL, HAS_WR, EVEN_D, HEAD_DIM, BLOCK_N, False)
        acc, m_i, l_i, p_bits, alpha = _fwd_inner_pipe(
            acc, m_i, l_i, p_bits, alpha, q, k_src, v_src, stride_kt, stride_vt, offs_m, offs_d, tl.maximum(fs, n1),
            fe, sk, diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p, TMA, PLAIN, SOFTCAP,
            HAS_ALIBI, HAS_DROPOUT, False, HAS_WL, HAS_WR, EVEN_D, HEAD_DIM, BLOCK_N, WS)
        acc, m_i, l_i, p_bits, alpha = _fwd_inner_pipe(
            acc, m_i, l_i, p_bits, alpha, q, k_src, v_src, stride_kt, stride_vt, offs_m, offs_d, tl.maximum(fe, n1),
            hi, sk, diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p, TMA, PLAIN, SOFTCAP,
            HAS_ALIBI, HAS_DROPOUT, True, HAS_WL, HAS_WR, EVEN_D, HEAD_DIM, BLOCK_N, False)
        if hi > lo:
            v = _load_kv(v_src, hi - BLOCK_N, offs_nb, offs_d, sk, stride_vt, TMA, True, EVEN_D, HEAD_DIM)
            acc = tl.dot(p_bits.to(v.dtype, bitcast=True), v, acc * alpha[:, None])
    else:
        # masked blocks left of the window, unmasked middle, masked diagonal / right edge
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_src, v_src, stride_kt, stride_vt, offs_m, offs_d, lo, fs,
                                   sk, diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p,
                                   TMA, PLAIN, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, True, HAS_WL, HAS_WR, EVEN_D,
                                   HEAD_DIM, BLOCK_N, False)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_src, v_src, stride_kt, stride_vt, offs_m, offs_d, fs, fe,
                                   sk, diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p,
                                   TMA, PLAIN, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, False, HAS_WL, HAS_WR, EVEN_D,
                                   HEAD_DIM, BLOCK_N, WS)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_src, v_src, stride_kt, stride_vt, offs_m, offs_d, fe, hi,
                                   sk, diag_off, slope2, wl, wr, qk_mult, cap_in, seed_bh, rng_stride, dropout_p,
                                   TMA, PLAIN, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, True, HAS_WL, HAS_WR, EVEN_D,
                                   HEAD_DIM, BLOCK_N, False)

    # 4. normalise; a row that saw no key: zero output, lse = +inf
    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    inv = 1.0 / l_safe
    if HAS_DROPOUT:
        inv = inv / (1.0 - dropout_p)
    acc = acc * inv[:, None]
    lse = tl.where(empty_row, float("inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    o_base = O + pid_b.to(tl.int64) * stride_ob + pid_h.to(tl.int64) * stride_oh + q_start * stride_ot
    tl.store(o_base + offs_m[:, None].to(tl.int64) * stride_ot + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=q_mask)
    l_base = LSE + pid_b.to(tl.int64) * stride_lb + pid_h.to(tl.int64) * stride_lh + q_start * stride_lt
    tl.store(l_base + offs_m.to(tl.int64) * stride_lt, lse, mask=offs_m < sq)


@triton.jit
def _flash_dropout_mask_kernel(SEED, MASK, seqlen_q, seqlen_k, rng_stride, dropout_p,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Materialise the keep-mask of one (batch, head) (tests and debugging). Grid (m, n, B*Hq)."""
    pid_bh = tl.program_id(2)
    seed_bh = tl.load(SEED).to(tl.int64) + pid_bh.to(tl.int64) * 4294967296
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _dropout_keep(seed_bh, offs_m[:, None], offs_n[None, :], rng_stride, dropout_p)
    ptr = MASK + pid_bh.to(tl.int64) * seqlen_q * seqlen_k + offs_m[:, None] * seqlen_k + offs_n[None, :]
    tl.store(ptr, keep.to(tl.int8), mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))
