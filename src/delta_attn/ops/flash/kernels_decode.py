"""Triton kernels of ``flash_attn_with_kvcache``: append, split-KV attention, merge.

- ``_kvcache_append_kernel``: one program per (new token, key head) rotates the new key (rotary) and
  writes it and its value into the cache at position ``cache_seqlens[b] + t`` (a cache row, or slot
  ``p % page`` of block ``block_table[b, p // page]``).
- ``_kvcache_attn_kernel``: one program per (query-row block, split, batch row, key head). Its rows are
  every (query, q head) pair of that key head's GQA group, so each key and value of the cache is read
  once per split for all the q heads sharing it. The keys visible to the block (after left padding and
  the window) are cut into ``num_splits`` contiguous ranges; each program runs the online softmax over
  its range (exp2 domain, scores masked as in ``kernels_fwd``), and writes either the final output and
  LSE (one split) or its normalised partial output and log2-sum-exp. HOIST (a tile constexpr): the
  tiles that every row of the block sees whole run without masks (loads or scores); only the edge tiles
  (window start, causal / window end, the range's last partial tile) mask.
- ``_kvcache_merge_kernel``: one program per (batch row, q head, query) combines the splits:
  ``lse = log sum_s exp(lse_s)``, ``out = sum_s exp(lse_s - lse) out_s``. A row that sees no key gets
  zeros and lse = +inf.
Positions are relative to the left padding inside the attention kernel: key j' is cache position
``j' + cache_leftpad[b]``, and ``Sk = cache_seqlens[b] + Snew - cache_leftpad[b]``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels_fwd import _scores, _score_scales


@triton.jit
def _load_rotated(ptr, d, sd, dmask, pos, COS, SIN, s_ro, s_rod, half, ROTARY: tl.constexpr,
                  INTERLEAVED: tl.constexpr):
    """Channels ``d`` of the row(s) at ``ptr`` (fp32), rotated at position(s) ``pos`` when ROTARY: pair
    (a, b) at angle t becomes (a cos t - b sin t, a sin t + b cos t); channels >= 2 * half pass through.
    Pairs are (2i, 2i + 1) when INTERLEAVED, else (i, i + half)."""
    x = tl.load(ptr + d * sd, mask=dmask, other=0.0).to(tl.float32)
    if ROTARY:
        if INTERLEAVED:
            partner = d ^ 1
            idx = d // 2
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        else:
            first = d < half
            partner = tl.where(first, d + half, d - half)
            idx = tl.where(first, d, d - half)
            sign = tl.where(first, -1.0, 1.0)
        m = dmask & (d < 2 * half)
        xp = tl.load(ptr + partner * sd, mask=m, other=0.0).to(tl.float32)
        c = tl.load(COS + pos * s_ro + idx * s_rod, mask=m, other=1.0).to(tl.float32)
        s = tl.load(SIN + pos * s_ro + idx * s_rod, mask=m, other=0.0).to(tl.float32)
        x = x * c + sign * xp * s
    return x


@triton.jit
def _cache_offsets(pos, b, kmask, BT, IDX, s_btb, s_btn, page, s_row, s_pos, PAGED: tl.constexpr,
                   HAS_IDX: tl.constexpr):
    """Element offset of cache position(s) ``pos`` of batch row ``b`` (64-bit): block
    ``block_table[b, pos // page]`` slot ``pos % page``, or row ``cache_batch_idx[b]`` (b) position ``pos``."""
    if PAGED:
        blk = tl.load(BT + b * s_btb + (pos // page) * s_btn, mask=kmask, other=0).to(tl.int64)
        return blk * s_row + (pos % page).to(tl.int64) * s_pos
    row = b
    if HAS_IDX:
        row = tl.load(IDX + b).to(tl.int64)
    return row * s_row + pos.to(tl.int64) * s_pos


@triton.jit
def _kvcache_append_kernel(KNEW, VNEW, KC, VC, SEQLENS, IDX, BT, COS, SIN,
                           s_nb, s_nt, s_nh, s_nd, s_wb, s_wt, s_wh, s_wd,
                           s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd,
                           s_btb, s_btn, s_ro, s_rod, snew, page, seqlen_ro, half,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
                           HAS_IDX: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // snew).to(tl.int64)
    t = pid % snew
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    pos = tl.load(SEQLENS + b) + t
    one = pos < 2147483647                       # a true scalar mask for the block-table load
    # rotary at the token's position (clamped to the table: never read past it)
    rpos = tl.minimum(pos, seqlen_ro - 1).to(tl.int64)
    k = _load_rotated(KNEW + b * s_nb + t * s_nt + h * s_nh, d, s_nd, dmask, rpos, COS, SIN, s_ro, s_rod, half,
                      ROTARY, INTERLEAVED)
    v = tl.load(VNEW + b * s_wb + t * s_wt + h * s_wh + d * s_wd, mask=dmask, other=0.0)
    k_off = _cache_offsets(pos, b, one, BT, IDX, s_btb, s_btn, page, s_kb, s_ks, PAGED, HAS_IDX)
    v_off = _cache_offsets(pos, b, one, BT, IDX, s_btb, s_btn, page, s_vb, s_vs, PAGED, HAS_IDX)
    tl.store(KC + k_off + h * s_kh + d * s_kd, k.to(KC.dtype.element_ty), mask=dmask)
    tl.store(VC + v_off + h * s_vh + d * s_vd, v.to(VC.dtype.element_ty), mask=dmask)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, n, K, V, b, i, d, dmask, lp, diag, slope2, wl, wr, end, qk_mult, cap_in,
                 BT, IDX, s_btb, s_btn, page, s_kb, s_ks, s_kd, s_vb, s_vs, s_vd,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                 HAS_IDX: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WL: tl.constexpr,
                 HAS_WR: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
    """One key tile [n, n + BLOCK_N) of the online softmax: scores, running max / sum, P @ V into ``acc``.
    MASKED: keys past ``end`` and outside the rows' windows are masked (loads and scores); otherwise
    every key of the tile is visible to every row and nothing is masked (the channel mask only when
    HEAD_DIM is not a power of two)."""
    j = n + tl.arange(0, BLOCK_N)              # key index relative to the left padding
    pos = j + lp                               # cache position
    if MASKED:
        kmask = j < end
        tile_mask = kmask[:, None] & dmask[None, :]
    else:
        kmask = j < 2147483647                 # the block-table load's mask: always true
        tile_mask = (j >= 0)[:, None] & dmask[None, :]
    k_off = _cache_offsets(pos, b, kmask, BT, IDX, s_btb, s_btn, page, s_kb, s_ks, PAGED, HAS_IDX)
    v_off = _cache_offsets(pos, b, kmask, BT, IDX, s_btb, s_btn, page, s_vb, s_vs, PAGED, HAS_IDX)
    k_ptr = K + k_off[:, None] + d[None, :] * s_kd
    v_ptr = V + v_off[:, None] + d[None, :] * s_vd
    if MASKED or HEAD_DIM != BLOCK_D:
        k = tl.load(k_ptr, mask=tile_mask, other=0.0)
    else:
        k = tl.load(k_ptr)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    s, _ = _scores(qk, i[:, None], j[None, :], diag, slope2[:, None], wl, wr, end, qk_mult, cap_in,
                   SOFTCAP, HAS_ALIBI, MASKED, HAS_WL, HAS_WR, True)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED or HEAD_DIM != BLOCK_D:
        v = tl.load(v_ptr, mask=tile_mask, other=0.0)
    else:
        v = tl.load(v_ptr)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _kvcache_attn_kernel(Q, KC, VC, O, LSE, OP, LP, SEQLENS, LEFTPAD, IDX, BT, ALIBI, COS, SIN,
                         s_qb, s_qs, s_qh, s_qd, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd,
                         s_ob, s_os, s_oh, s_od, s_lb, s_lh, s_ls, s_btb, s_btn, s_ab, s_ah, s_ro, s_rod,
                         seqlen_q, snew, n_kv_heads, group, page, seqlen_ro, half, scale, softcap, wl, wr,
                         num_splits, row_blocks,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, PAGED: tl.constexpr, HAS_IDX: tl.constexpr,
                         HAS_LEFTPAD: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                         HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, ROTARY: tl.constexpr,
                         INTERLEAVED: tl.constexpr, ROTARY_PER_QUERY: tl.constexpr, SPLIT: tl.constexpr,
                         IEEE: tl.constexpr, HOIST: tl.constexpr):
    pid0 = tl.program_id(0)
    rb = pid0 % row_blocks
    split = pid0 // row_blocks
    bh = tl.program_id(1)
    b = (bh // n_kv_heads).to(tl.int64)
    hk = (bh % n_kv_heads).to(tl.int64)
    n0 = tl.load(SEQLENS + b)
    lp = 0
    if HAS_LEFTPAD:
        lp = tl.load(LEFTPAD + b)
    sk = n0 + snew - lp                       # keys this row may see at most
    diag = sk - seqlen_q                      # bottom-right alignment: query i's diagonal is key i + diag

    # 1. the block's rows: (query i, q head h) pairs of this key head's group, rotated q in the input dtype
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    n_rows = seqlen_q * group
    rmask = r < n_rows
    i = r // group
    h = hk * group + r % group
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    qpos = n0 + 0 * i                          # rotary: every query at cache_seqlens, or at cache_seqlens + i
    if ROTARY_PER_QUERY:
        qpos += i
    qpos = tl.minimum(qpos, seqlen_ro - 1).to(tl.int64)
    q_ptr = Q + b * s_qb + i.to(tl.int64)[:, None] * s_qs + h[:, None] * s_qh
    q = _load_rotated(q_ptr, d[None, :], s_qd, rmask[:, None] & dmask[None, :], qpos[:, None], COS, SIN, s_ro, s_rod,
                      half, ROTARY, INTERLEAVED).to(Q.dtype.element_ty)
    slope2 = tl.zeros([BLOCK_M], tl.float32)
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b * s_ab + h * s_ah, mask=rmask, other=0.0).to(tl.float32) * 1.4426950408889634
    qk_mult, cap_in = _score_scales(scale, softcap, SOFTCAP)

    # 2. the keys visible to the block, cut into num_splits ranges of whole key tiles
    i_first = (rb * BLOCK_M) // group
    i_last = (tl.minimum(rb * BLOCK_M + BLOCK_M, n_rows) - 1) // group
    lo = 0
    hi = sk
    if HAS_WL:
        lo = tl.maximum(i_first + diag - wl, 0)
    if HAS_WR:
        hi = tl.minimum(i_last + diag + wr + 1, sk)
    hi = tl.maximum(hi, lo)
    per = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per
    end = tl.minimum(start + per, hi)

    # 3. online softmax over this split's keys (log2 domain). HOIST: the tiles every row sees whole
    #    (inside the window, before ``end``) run unmasked; only the edge tiles before / after them mask
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = KC + hk * s_kh
    v_base = VC + hk * s_vh
    if HOIST:
        body_lo = start
        if HAS_WL:                             # first key every row sees, on the split's tile grid
            first_all = tl.minimum(tl.maximum(i_last + diag - wl, start), end)
            body_lo = start + tl.cdiv(first_all - start, BLOCK_N) * BLOCK_N
            for n in range(start, body_lo, BLOCK_N):
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n, k_base, v_base, b, i, d, dmask, lp, diag, slope2,
                                             wl, wr, end, qk_mult, cap_in, BT, IDX, s_btb, s_btn, page, s_kb, s_ks,
                                             s_kd, s_vb, s_vs, s_vd, HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, HAS_IDX,
                                             SOFTCAP, HAS_ALIBI, HAS_WL, HAS_WR, IEEE, True)
        last_all = end                         # one past the last key every row sees
        if HAS_WR:
            last_all = tl.minimum(end, i_first + diag + wr + 1)
        body_hi = body_lo + tl.maximum(last_all - body_lo, 0) // BLOCK_N * BLOCK_N
        for n in range(body_lo, body_hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n, k_base, v_base, b, i, d, dmask, lp, diag, slope2,
                                         wl, wr, end, qk_mult, cap_in, BT, IDX, s_btb, s_btn, page, s_kb, s_ks,
                                         s_kd, s_vb, s_vs, s_vd, HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, HAS_IDX,
                                         SOFTCAP, HAS_ALIBI, HAS_WL, HAS_WR, IEEE, False)
        tail = tl.maximum(body_hi, body_lo)
    else:
        tail = start
    for n in range(tail, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n, k_base, v_base, b, i, d, dmask, lp, diag, slope2,
                                     wl, wr, end, qk_mult, cap_in, BT, IDX, s_btb, s_btn, page, s_kb, s_ks,
                                     s_kd, s_vb, s_vs, s_vd, HEAD_DIM, BLOCK_D, BLOCK_N, PAGED, HAS_IDX,
                                     SOFTCAP, HAS_ALIBI, HAS_WL, HAS_WR, IEEE, True)

    # 4. normalised output and log2-sum-exp of the split (zeros / -inf where no key was seen)
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    omask = rmask[:, None] & dmask[None, :]
    if SPLIT:
        row = ((b * n_kv_heads * group + h) * seqlen_q + i) * num_splits + split
        tl.store(OP + row[:, None] * HEAD_DIM + d[None, :], o, mask=omask)
        tl.store(LP + row, lse2, mask=rmask)
    else:
        o_ptr = O + b * s_ob + i.to(tl.int64)[:, None] * s_os + h[:, None] * s_oh + d[None, :] * s_od
        tl.store(o_ptr, o.to(O.dtype.element_ty), mask=omask)
        lse = tl.where(seen, lse2 * 0.6931471805599453, float("inf"))
        tl.store(LSE + b * s_lb + h * s_lh + i * s_ls, lse, mask=rmask)


@triton.jit
def _kvcache_merge_kernel(OP, LP, O, LSE, s_ob, s_os, s_oh, s_od, s_lb, s_lh, s_ls, seqlen_q, n_heads,
                          num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)          # (b * Hq + h) * Sq + i
    i = row % seqlen_q
    h = (row // seqlen_q) % n_heads
    b = row // (seqlen_q * n_heads)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    lse_s = tl.load(LP + row * num_splits + sp, mask=smask, other=float("-inf"))
    top = tl.max(lse_s, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse_s - top_safe)                # 0 for splits that saw no key
    total = tl.sum(w, 0)
    parts = tl.load(OP + (row * num_splits + sp)[:, None] * HEAD_DIM + d[None, :],
                    mask=smask[:, None] & dmask[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    lse = tl.where(total > 0, (top_safe + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453,
                   float("inf"))
    tl.store(O + b * s_ob + i * s_os + h * s_oh + d * s_od, o.to(O.dtype.element_ty), mask=dmask)
    tl.store(LSE + b * s_lb + h * s_lh + i * s_ls, lse)
