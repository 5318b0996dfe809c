"""Triton kernels of gated diagonal attention: ``s_t = exp(g_t) * s_{t-1} + k_t * v_t``, ``o_t = q_t * s_t``.

Layout: q, k, v, g, o are packed ``(total, H, D)`` (a fixed batch ``(B, T, H, D)`` is the packed batch
of B sequences of T tokens), so every channel of the flattened H * D axis is one *chain* along the packed
time axis. Sequence boundaries inside a chain are handled by the scan itself: a sequence's first token is
a *reset* map ``s -> b`` (its A marked ``RESET`` < 0, the initial state folded into the input:
``b = exp(g) * s0 + k * v``, s0 = 0 without one), and every composition and application of maps
*selects* at a reset (``_scan_combine``, ``_apply``) instead of multiplying the state before it by 0:
``0 * NaN = NaN`` would carry a NaN (or an inf) of one sequence into the next. So nothing leaks from one
sequence into another, a NaN gate included: it makes its own sequence's state NaN from its token on
(a full decay after it keeps it NaN, as ``exp(-1e4) * NaN`` does in the specification).

Forward (``_diag_fwd_rows_kernel``), one program per (time tile of BT rows, block of BD channels of the
flattened H * D axis), single pass; no data crosses threads in the time scan (each thread walks the rows
of its own channels):
  1. the program id gives the tile; ids walk the channel blocks first, so the tiles of one chain start
     in time order (blocks are dispatched in index order: the look-back below cannot dead-lock);
  2. the tile's rows, cut into SPLIT segments walked side by side by their own threads, are scanned as
     affine maps ``s -> a_t s + b_t``; the segments' maps are combined once per tile;
  3. publish the tile's aggregate map (A, B) per channel, then *decoupled look-back*
     (``_lookback_walk``): compose the predecessors' published maps until a *stop* word (an inclusive
     state, or a map that resets: a sequence starts in that tile), which gives the state entering the
     tile; publish the tile's inclusive state (a stop word, B = state at its last row);
  4. write ``o = q * s`` and the final states of the sequences that end in the tile; a training forward
     also writes the state at the end of every segment: the backward's carries.
Long tiles walked as segments keep few tiles of a chain in flight when a tile looks back (the cost of
the look-back), with the registers of a short tile.
Every published word packs (valid bit | A bits, B bits) into one int64 per channel, so a reader needs
no memory fence: a word is either zero (not yet written) or a complete, consistent pair. A bits 0 is
the stop mark (``_pack``, ``_pack_incl``): an aggregate whose A underflowed to 0 (a full decay) is
published as the smallest subnormal instead, so the look-back never stops on it (that would drop a NaN
before it: decided by timing on a GPU, and not what the specification computes).

Backward (``_diag_bwd_rows_kernel``), the same scheme run from the last tile to the first:
  ``ds_t = exp(g_{t+1}) ds_{t+1} + do_t q_t (+ dfinal at a sequence end)``, a reverse walk over the rows
  with look-back to the right; the states ``s_t`` are recomputed from the forward's carries; then
  ``dq = do s``, ``dk = ds v``, ``dv = ds k``, ``dg = ds (s_t - k_t v_t) = ds exp(g_t) s_{t-1}`` and
  ``d s0 = exp(g_first) ds_first``.

Decode (``_diag_step_kernel``): the recurrence token by token on a state pool, in place; a program owns a
block of the flattened H * D channels of one sequence (``ops/_slots.py`` gives its slots).

Context parallelism's summary (``_diag_summary_kernel``, ``_diag_summary_combine_kernel``; used by
``delta_attn/distributed/diag.py``): per channel of rows [t0, t1) of every batch row, the decay product and
the state from 0 (forward: one read of k, v, g) or the gradient of the state before the rows (reverse: one
read of q, do, g), with an edge term (the rows' initial state, or the final state's gradient); programs own
chunks of rows, composed in time order by a second launch when there are several.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._slots import _start_slot, _token_slot

# a published word with the valid bit set, A bits 0 (stop) and B = 0: "state 0, nothing before matters"
INCL_ZERO = -(1 << 63)
_INCL_ZERO: tl.constexpr = tl.constexpr(INCL_ZERO)
# the A of a map that ignores the state before it (s -> B: a sequence starts inside it). Decays are >= 0
# or NaN, so a negative A is free to mean it; a reset is applied by a select, never by a multiply by 0
RESET = -1.0
_RESET: tl.constexpr = tl.constexpr(RESET)


@triton.jit
def _scan_combine(a1, b1, a2, b2):
    # (a1, b1) then (a2, b2): s -> a2 (a1 s + b1) + b2, where a reset (a < 0) drops what came before it
    # by a select (a NaN before it stays there) and the composition of a reset is a reset
    a = tl.where((a1 < 0) | (a2 < 0), _RESET, a1 * a2)
    b = tl.where(a2 < 0, b2, a2 * b1 + b2)
    return a, b


@triton.jit
def _apply(a, b, s):
    """The map (a, b) applied to the state s: b for a reset (a < 0), else a s + b."""
    return tl.where(a < 0, b, a * s + b)


@triton.jit
def _pack(a, b):
    """A tile's aggregate map -> int64 word: bit 63 valid, bits 62..32 |A|, bits 31..0 B. A reset map
    (A < 0) gets A bits 0, the stop mark; an A of 0 (underflow) the smallest subnormal, so that it is
    composed, not taken for a stop (a NaN before a full decay stays NaN)."""
    a_bits = a.to(tl.int32, bitcast=True).to(tl.int64) & 0x7FFFFFFF
    a_bits = tl.where(a < 0, 0, tl.maximum(a_bits, 1))
    b_bits = b.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return ((a_bits << 32) | b_bits) | _INCL_ZERO


@triton.jit
def _pack_incl(s):
    """An inclusive state -> int64 word (A bits 0: the look-back stops here, its B is the state)."""
    return (s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) | _INCL_ZERO


@triton.jit
def _unpack(word):
    """int64 word -> (published, A, B, stop: an inclusive state or a reset map)."""
    a_bits = (word >> 32) & 0x7FFFFFFF
    a = a_bits.to(tl.int32).to(tl.float32, bitcast=True)
    b = (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    return word < 0, a, b, a_bits == 0


@triton.jit
def _seq_info(rows, cu, T_seq, N, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr):
    """Sequence index of each packed row (a tensor of rows or one row) and whether the row starts /
    ends its sequence."""
    if IS_VARLEN:
        # largest n < N with cu[n] <= row (zero-length sequences share cu values: take the last)
        lo = rows.to(tl.int32) * 0     # (rows: a tensor or a scalar)
        hi = lo + (N - 1)
        for _ in tl.static_range(LOG_N):
            mid = (lo + hi + 1) // 2
            go = tl.load(cu + mid).to(tl.int64) <= rows
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid - 1)
        seq = lo.to(tl.int64)
        start = rows == tl.load(cu + lo).to(tl.int64)
        end = rows == tl.load(cu + lo + 1).to(tl.int64) - 1
    else:
        seq = rows // T_seq
        pos = rows - seq * T_seq
        start = pos == 0
        end = pos == T_seq - 1
    return seq, start, end


@triton.jit
def _ld(ptr, m, EVEN: tl.constexpr):
    if EVEN:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=m, other=0.0)
    return x


@triton.jit
def _st(ptr, x, m, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, x)
    else:
        tl.store(ptr, x, mask=m)


@triton.jit
def _empty_sequences_pass_through(src, dst, cu, N, chan, cmask, HD: tl.constexpr, HAS_SRC: tl.constexpr,
                                  BD: tl.constexpr):
    """dst[n] = src[n] (or 0 without a source) on this program's channels for every zero-length
    sequence n of a packed batch: its state passes through untouched (run by one tile per chain)."""
    n = tl.zeros([1], tl.int64)
    while tl.sum(n) < N:   # (a while loop: the interpreter cannot range() over a runtime int)
        nb = tl.sum(n)
        empty_seq = (tl.load(cu + n) == tl.load(cu + n + 1))
        if HAS_SRC:
            x = tl.load(src + nb * HD + chan, mask=cmask, other=0.0).to(tl.float32)
        else:
            x = tl.zeros([BD], tl.float32)
        tl.store(dst + nb * HD + chan, x, mask=cmask & empty_seq)
        n += 1


@triton.jit
def _lookback_walk(ws, j, chan, cmask, stride_tile, n_tiles, REVERSE: tl.constexpr, W: tl.constexpr):
    """Carry entering tile j (decoupled look-back over the chain's tiles before it, after it when
    REVERSE): each channel walks its
    own predecessors, W published words per probe (issued together: one round trip), composing them in
    order up to the first stop word (an inclusive state or a reset map) or the first word not yet
    published, where its next probe starts. Only W words per channel are live (no [W, BD] window
    reductions), so a wide window is cheap in registers, and a late word stops one channel, not the
    whole window."""
    acc_a = tl.full(chan.shape, 1.0, tl.float32)
    acc_b = tl.zeros(chan.shape, tl.float32)
    done = cmask == 0
    cur = tl.zeros(chan.shape, tl.int32) + j    # per channel: the maps of tiles beyond cur are composed
    while tl.max((done == 0).to(tl.int32), axis=0) > 0:
        # the W loads of a probe first (independent: one round trip); outside the chain reads as
        # "state 0, nothing before matters"
        words = ()
        for w in tl.static_range(W):
            if REVERSE:
                t = cur + 1 + w
                inside = t < n_tiles
            else:
                t = cur - 1 - w
                inside = t >= 0
            words = words + (tl.load(ws + t.to(tl.int64) * stride_tile + chan, mask=inside & (done == 0),
                                     other=_INCL_ZERO, volatile=True),)
        # then compose them in order, per channel, up to a stop word or a word not yet published (a
        # product of A's that underflows to 0 is no stop: 0 * NaN before it must stay NaN)
        halt = done
        for w in tl.static_range(W):
            ready, a, b, stop = _unpack(words[w])
            take = (halt == 0) & ready
            acc_b = tl.where(take, acc_b + acc_a * b, acc_b)
            acc_a = tl.where(take, acc_a * a, acc_a)
            if REVERSE:
                cur = tl.where(take, cur + 1, cur)
            else:
                cur = tl.where(take, cur - 1, cur)
            done = done | (take & stop)
            halt = halt | (ready == 0) | done
    return acc_b


@triton.jit
def _row_flags(i: tl.constexpr, rows0, seg, seq0, p0, cu, T_seq, total, N, cmask, IS_VARLEN: tl.constexpr,
               LOG_N: tl.constexpr, R: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr):
    """Row i of every segment of a rows-tile (rows0: the segments' first rows; seg: the element's
    segment, SPLIT segments of R rows): (sequence index, starts its sequence, ends it, mask)."""
    if EVEN:
        # fixed length, T % BT == 0: only the tile's first row may start a sequence, its last end one
        seq = seq0
        start = (p0 == 0) & (i == 0)
        end = (p0 + R * SPLIT == T_seq) & (i == R - 1)
        if SPLIT > 1:
            start = start & (seg == 0)
            end = end & (seg == SPLIT - 1)
        m = cmask
    else:
        row = rows0 + i
        seq, start, end = _seq_info(row, cu, T_seq, N, IS_VARLEN, LOG_N)
        m = cmask & (row < total)
    return seq, start, end, m


@triton.jit
def _exp(x, FAST_EXP: tl.constexpr):
    if FAST_EXP:
        # 2^(x log2 e) by one MUFU.EX2, subnormal results flushed to 0 (decays down to -1e4 give 0)
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _row_map(k, v, g, h0, x, seq, start, chan, m, i: tl.constexpr, HD: tl.constexpr, HAS_H0: tl.constexpr,
             EVEN: tl.constexpr, FAST_EXP: tl.constexpr):
    """The row's map s -> a s + b per channel (a reset at a sequence start: a = RESET, exp(g) s0 folded
    into b, s0 = 0 without initial states); rows past the end read g = 0, k v = 0: the identity."""
    a = _exp(_ld(g + x, m, EVEN).to(tl.float32), FAST_EXP)
    b = _ld(k + x, m, EVEN).to(tl.float32) * _ld(v + x, m, EVEN).to(tl.float32)
    if (not EVEN) or (i == 0):
        if HAS_H0:
            s0 = tl.load(h0 + seq * HD + chan, mask=m & start, other=0.0).to(tl.float32)
        else:
            s0 = 0.0
        b += tl.where(start, a * s0, 0.0)
        a = tl.where(start, _RESET, a)
    return a, b


@triton.jit
def _then(acc_a, acc_b, a, b, i: tl.constexpr, FIRST: tl.constexpr, EVEN: tl.constexpr):
    """The running map (acc_a, acc_b) followed by row i's (a, b). A reset (a sequence start) can only sit
    on row FIRST of an EVEN tile: the other rows compose by plain multiplies (their A is then not kept
    a reset: ``_held`` selects by the tile's flag instead)."""
    if (not EVEN) or (i == FIRST):
        acc_a, acc_b = _scan_combine(acc_a, acc_b, a, b)
    else:
        acc_b = a * acc_b + b
        acc_a = acc_a * a
    return acc_a, acc_b


@triton.jit
def _held(a, b, s, reset, EVEN: tl.constexpr):
    """A prefix map (a, b) of ``_then`` applied to s: by ``reset`` (the EVEN tile's or segment's first row
    starts a sequence) or by the map's own mark."""
    if EVEN:
        y = tl.where(reset, b, a * s + b)
    else:
        y = _apply(a, b, s)
    return y


@triton.jit
def _segment_scan(acc_a, acc_b, SPLIT: tl.constexpr, BD: tl.constexpr):
    """Split rows-tiles: the segments' maps ([SPLIT * BD], segment-major) composed in time order, an
    inclusive scan over the segments ([SPLIT, BD]; across warps, once per tile), and the tile's map
    (the last segment's inclusive map) given to every segment's elements ([SPLIT * BD])."""
    ia, ib = tl.associative_scan((tl.reshape(acc_a, [SPLIT, BD]), tl.reshape(acc_b, [SPLIT, BD])), 0,
                                 _scan_combine)   # (resets: select)
    last = (tl.arange(0, SPLIT) == SPLIT - 1)[:, None]
    ta = tl.broadcast_to(tl.sum(tl.where(last, ia, 0.0), axis=0)[None, :], [SPLIT, BD])
    tb = tl.broadcast_to(tl.sum(tl.where(last, ib, 0.0), axis=0)[None, :], [SPLIT, BD])
    return ia, ib, tl.reshape(ta, [SPLIT * BD]), tl.reshape(tb, [SPLIT * BD])


@triton.jit
def _segment_entry_states(ia, ib, s_in, SPLIT: tl.constexpr, BD: tl.constexpr):
    """The state entering each segment ([SPLIT * BD]) from the inclusive maps of ``_segment_scan``
    and the state entering the tile (s_in: [SPLIT * BD], valid in segment 0): the state at the end
    of each segment (also returned), shifted by one."""
    v = tl.arange(0, SPLIT)
    s0 = tl.sum(tl.where(v[:, None] == 0, tl.reshape(s_in, [SPLIT, BD]), 0.0), axis=0)
    s_end = _apply(ia, ib, s0[None, :])
    prev = v[None, :, None] == v[:, None, None] - 1
    s_seg = tl.sum(tl.where(prev, s_end[None, :, :], 0.0), axis=1) + tl.where(v[:, None] == 0, s0[None, :], 0.0)
    return tl.reshape(s_seg, [SPLIT * BD]), tl.reshape(s_end, [SPLIT * BD])


@triton.jit
def _diag_fwd_rows_kernel(q, k, v, g, o, h0, ht, ws, cu,
                          T_seq, total, N, n_tiles, carries,
                          H: tl.constexpr, D: tl.constexpr,
                          HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
                          LOG_N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, W: tl.constexpr,
                          EVEN: tl.constexpr, FAST_EXP: tl.constexpr, SPLIT: tl.constexpr,
                          STORE_CARRIES: tl.constexpr):
    """Forward. A program owns BD channels of the flattened (H * D) channel axis (a block may span
    heads: every channel is its own chain) and walks the tile's rows one vector at a time, each thread
    carrying the state of its own channels. The tile's BT rows are cut into SPLIT (> 1) segments of
    BT / SPLIT rows walked side by side (each by its own threads: a long tile, few tiles per chain in
    flight, with the registers of a short one); their maps are combined once per tile, and
    STORE_CARRIES (a training forward) writes the state at the end of every segment (the backward's
    carries).
      1. local scan from state 0 and the cumulative decay (B, A) of each segment, keeping every row's
         prefix (A_i, B_i) in registers (2 per element: short segments) and q (loaded before the
         look-back: its latency hidden behind it);
      2. publish the tile's aggregate map, look back for the entering state s_in, publish the
         inclusive state; the states entering the segments;
      3. the states s_i = A_i s_seg + B_i, writing o = q s and the final states.
    The look-back is ``_lookback_walk`` (per-channel walk). FAST_EXP (GPU only): exp(g) as one
    ex2.approx.ftz (results below 2^-126 flush to 0) instead of Triton's denormal-safe sequence."""
    HD: tl.constexpr = H * D
    N_CB: tl.constexpr = (HD + BD - 1) // BD
    R: tl.constexpr = BT // SPLIT
    pid = tl.program_id(0)
    j = pid // N_CB
    chan_t = (pid % N_CB) * BD + tl.arange(0, BD)
    cmask_t = chan_t < HD
    row0 = j.to(tl.int64) * BT
    seq0 = row0 // T_seq
    p0 = row0 - seq0 * T_seq
    # element e of a row step: segment e // BD, channel e % BD
    lane = tl.arange(0, SPLIT * BD)
    seg = lane // BD
    chan = (pid % N_CB) * BD + lane % BD
    rows0 = row0 + seg * R
    reset = (p0 == 0) & (seg == 0)
    # (reset, EVEN: a sequence can only start at the tile's first row: the segment's map is a reset)
    cmask = chan < HD
    p = rows0 * HD + chan

    # 1. local scan from zero and the product of the decays, row by row; every row's prefix (A_i, B_i)
    #    and q kept in registers (tuples of R [SPLIT * BD] vectors)
    acc_b = tl.zeros(chan.shape, tl.float32)
    acc_a = tl.full(chan.shape, 1.0, tl.float32)
    held = ()
    qs = ()
    for i in tl.static_range(R):
        seq, start, end, m = _row_flags(i, rows0, seg, seq0, p0, cu, T_seq, total, N, cmask, IS_VARLEN, LOG_N,
                                        R, SPLIT, EVEN)
        a, b = _row_map(k, v, g, h0, p + i * HD, seq, start, chan, m, i, HD, HAS_H0, EVEN, FAST_EXP)
        acc_a, acc_b = _then(acc_a, acc_b, a, b, i, 0, EVEN)
        held = held + ((acc_a, acc_b),)
        qs = qs + (_ld(q + p + i * HD, m, EVEN),)

    # 2. publish the aggregate, look back for the entering state, publish the inclusive state; segment
    #    0's threads do all three (one owner per word: the inclusive word is stored after the aggregate
    #    by the same thread, and no copy of the walk lives in another warp)
    if EVEN:
        acc_a = tl.where(reset, _RESET, acc_a)   # the segment's map marked a reset again (see _then)
    ia, ib, tile_a, tile_b = _segment_scan(acc_a, acc_b, SPLIT, BD)
    lead = cmask & (seg == 0)
    wptr = ws + j.to(tl.int64) * HD + chan
    tl.store(wptr, _pack(tile_a, tile_b), mask=lead)
    s_in = _lookback_walk(ws, j, chan, lead, HD, n_tiles, False, W)
    tl.store(wptr, _pack_incl(_apply(tile_a, tile_b, s_in)), mask=lead)
    s_seg, s_end = _segment_entry_states(ia, ib, s_in, SPLIT, BD)
    if STORE_CARRIES:
        # the state at the end of every segment, as inclusive words: the backward's carries at
        # BT / SPLIT rows (the tile words above serve the look-back only)
        tl.store(carries + (j.to(tl.int64) * SPLIT + seg) * HD + chan, _pack_incl(s_end), mask=cmask)

    # 3. the states row by row from s_seg: o = q s, final states at sequence ends
    for i in tl.static_range(R):
        seq, start, end, m = _row_flags(i, rows0, seg, seq0, p0, cu, T_seq, total, N, cmask, IS_VARLEN, LOG_N,
                                        R, SPLIT, EVEN)
        x = p + i * HD
        s = _held(held[i][0], held[i][1], s_seg, reset, EVEN)
        _st(o + x, (qs[i].to(tl.float32) * s).to(o.dtype.element_ty), m, EVEN)
        if STORE_FINAL:
            if (not EVEN) or (i == R - 1):
                tl.store(ht + seq * HD + chan, s, mask=m & end)
    if STORE_FINAL:
        if IS_VARLEN:
            # zero-length sequences: the final state is the initial one; tile 0 writes it
            if j == 0:
                _empty_sequences_pass_through(h0, ht, cu, N, chan_t, cmask_t, HD, HAS_H0, BD)


@triton.jit
def _diag_bwd_rows_kernel(q, k, v, g, do, dq, dk, dv, dg, h0, dht, dh0, ws_f, ws_b, cu,
                          T_seq, total, N, n_tiles, carry_stride,
                          H: tl.constexpr, D: tl.constexpr,
                          HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
                          LOG_N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, W: tl.constexpr,
                          EVEN: tl.constexpr, FAST_EXP: tl.constexpr):
    """Backward: as the forward, a program owns BD channels of the flattened H * D axis and walks rows;
    no data crosses threads. Tiles from the end of each chain (the look-back runs to the right):
      1. rows from last to first: ds_t = a_{t+1} ds_{t+1} + do_t q_t (+ dfinal at a sequence end) from
         ds = 0 after the tile, keeping every row's map (RA_t, RB_t) (ds_t = RA_t x_in + RB_t) in
         registers (2 per element); each g row is read once (a_{t+1} carried to the next row);
      2. publish the aggregate (RA_0, RB_0), look back to the right for x_in (ds after the tile),
         publish the inclusive ds_0;
      3. rows from first to last: the states s_t from the forward's tile carry (g, k, v read, do
         re-read), ds_t = RA_t x_in + RB_t, dq = do s, dk = ds v, dv = ds k, dg = ds (s - k v),
         d s0 = exp(g_first) ds_first."""
    HD: tl.constexpr = H * D
    N_CB: tl.constexpr = (HD + BD - 1) // BD
    pid = tl.program_id(0)
    j = n_tiles - 1 - pid // N_CB
    chan = (pid % N_CB) * BD + tl.arange(0, BD)
    cmask = chan < HD
    row0 = j.to(tl.int64) * BT
    seq0 = row0 // T_seq
    p0 = row0 - seq0 * T_seq
    p = row0 * HD + chan

    # 1. the reverse scan, last row first; a_next = decay of the row after the current one (the next
    #    tile's first row for the last row: 0 past the end)
    nxt = (row0 + BT) < total
    a_next = _exp(tl.load(g + p + BT * HD, mask=cmask & nxt, other=0.0).to(tl.float32), FAST_EXP)
    a_next = tl.where(nxt, a_next, 0.0)
    ra = tl.full([BD], 1.0, tl.float32)
    rb = tl.zeros([BD], tl.float32)
    held = ()
    for i in tl.static_range(BT - 1, -1, -1):
        seq, start, end, m = _row_flags(i, row0, 0, seq0, p0, cu, T_seq, total, N, cmask, IS_VARLEN,
                                        LOG_N, BT, 1, EVEN)
        x = p + i * HD
        beta = _ld(do + x, m, EVEN).to(tl.float32) * _ld(q + x, m, EVEN).to(tl.float32)
        an = a_next
        if (not EVEN) or (i == BT - 1):
            # the row ends its sequence: nothing flows back from the next one (a reset); dfinal enters here
            an = tl.where(end, _RESET, an)
            if HAS_DHT:
                beta += tl.load(dht + seq * HD + chan, mask=m & end, other=0.0).to(tl.float32)
        ra, rb = _then(ra, rb, an, beta, i, BT - 1, EVEN)
        held = ((ra, rb),) + held
        if i > 0:
            a_next = _exp(_ld(g + x, m, EVEN).to(tl.float32), FAST_EXP)

    # 2. publish the aggregate, look back to the right, publish the inclusive ds of the first row
    #    (EVEN: only the tile's last row can end a sequence; then the tile's map is a reset)
    reset = p0 + BT == T_seq
    if EVEN:
        ra = tl.where(reset, _RESET, ra)
    wptr = ws_b + j.to(tl.int64) * HD + chan
    tl.store(wptr, _pack(ra, rb), mask=cmask)
    x_in = _lookback_walk(ws_b, j, chan, cmask, HD, n_tiles, True, W)
    tl.store(wptr, _pack_incl(_apply(ra, rb, x_in)), mask=cmask)

    # 3. states from the forward's carry, then the gradients row by row
    jc = j.to(tl.int64) * carry_stride - 1
    carry = tl.load(ws_f + jc * HD + chan, mask=cmask & (jc >= 0), other=0)
    s = tl.where(jc >= 0, (carry & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    for i in tl.static_range(BT):
        seq, start, end, m = _row_flags(i, row0, 0, seq0, p0, cu, T_seq, total, N, cmask, IS_VARLEN,
                                        LOG_N, BT, 1, EVEN)
        x = p + i * HD
        decay = _exp(_ld(g + x, m, EVEN).to(tl.float32), FAST_EXP)
        kr = _ld(k + x, m, EVEN).to(tl.float32)
        vr = _ld(v + x, m, EVEN).to(tl.float32)
        kv = kr * vr
        if (not EVEN) or (i == 0):
            # a sequence start selects its own initial state (0 without one), never 0 * the carry
            if HAS_H0:
                s0 = tl.load(h0 + seq * HD + chan, mask=m & start, other=0.0).to(tl.float32)
            else:
                s0 = 0.0
            s = tl.where(start, decay * s0 + kv, decay * s + kv)
        else:
            s = decay * s + kv
        ds = _held(held[i][0], held[i][1], x_in, reset, EVEN)
        _st(dq + x, (_ld(do + x, m, EVEN).to(tl.float32) * s).to(dq.dtype.element_ty), m, EVEN)
        _st(dk + x, (ds * vr).to(dk.dtype.element_ty), m, EVEN)
        _st(dv + x, (ds * kr).to(dv.dtype.element_ty), m, EVEN)
        _st(dg + x, (ds * (s - kv)).to(dg.dtype.element_ty), m, EVEN)
        if HAS_H0:
            if (not EVEN) or (i == 0):
                tl.store(dh0 + seq * HD + chan, decay * ds, mask=m & start)
    if HAS_H0:
        if IS_VARLEN:
            # zero-length sequences pass the final state's gradient straight through
            if j == 0:
                _empty_sequences_pass_through(dht, dh0, cu, N, chan, cmask, HD, HAS_DHT, BD)


@triton.jit
def _diag_step_kernel(q, k, v, g, o, state, idx, nat, T, HD,
                      IDX: tl.constexpr, HAS_NAT: tl.constexpr, BD: tl.constexpr, EVEN: tl.constexpr):
    # one program per (sequence, block of BD channels of the flattened H * D axis): the state block is read
    # from its start slot (ops/_slots.py), walked over the new tokens in registers and written back (to each
    # token's slot with (B, T) indices, else once to the start slot)
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < HD
    s_start = state + _start_slot(idx, nat, b, T, IDX, HAS_NAT) * HD + cols
    s = _ld(s_start, cmask, EVEN).to(tl.float32)
    t = 0
    while t < T:   # (a while loop: the interpreter cannot range() over a runtime int)
        off = (b * T + t) * HD + cols
        gt = _ld(g + off, cmask, EVEN).to(tl.float32)
        kt = _ld(k + off, cmask, EVEN).to(tl.float32)
        vt = _ld(v + off, cmask, EVEN).to(tl.float32)
        qt = _ld(q + off, cmask, EVEN).to(tl.float32)
        s = tl.exp(gt) * s + kt * vt
        _st(o + off, (qt * s).to(o.dtype.element_ty), cmask, EVEN)
        if IDX == 2:
            _st(state + _token_slot(idx, b, T, t) * HD + cols, s.to(state.dtype.element_ty), cmask, EVEN)
        t += 1
    if IDX != 2:
        _st(s_start, s.to(state.dtype.element_ty), cmask, EVEN)


@triton.jit
def _summary_rows(x, y, g, base, r0, r1, chan, cmask, HD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                  REVERSE: tl.constexpr):
    """(A, S) of rows [r0, r1) of one chain block: A = prod exp(g); forward S = the state after the rows from
    state 0 (``s = exp(g) s + x y``); REVERSE S = sum_t exp(g_r0 + ... + g_t) x_t y_t. Rows are walked BT at
    a time, unrolled (their loads issued together); rows past r1 read g = 0, x y = 0: the identity."""
    acc_a = tl.full([BD], 1.0, tl.float32)
    acc_s = tl.zeros([BD], tl.float32)
    r = r0
    while r < r1:   # (a while loop: the interpreter cannot range() over a runtime int)
        for i in tl.static_range(BT):
            m = cmask & (r + i < r1)
            off = base + (r + i) * HD + chan
            a = tl.exp(tl.load(g + off, mask=m, other=0.0).to(tl.float32))
            xy = tl.load(x + off, mask=m, other=0.0).to(tl.float32) * tl.load(y + off, mask=m, other=0.0).to(tl.float32)
            if REVERSE:
                acc_a = acc_a * a
                acc_s = acc_s + acc_a * xy
            else:
                acc_s = a * acc_s + xy
                acc_a = acc_a * a
        r += BT
    return acc_a, acc_s


@triton.jit
def _summary_finish(acc_a, acc_s, edge, out_m, out_s, seg, chan, cmask, HD: tl.constexpr, REVERSE: tl.constexpr,
                    HAS_EDGE: tl.constexpr):
    """Write a segment's decay product and its S with the edge term: forward, the state entering the rows
    carried through them (``A s0 + S``); REVERSE, the gradient after the last row carried back (``S + A d``)."""
    if HAS_EDGE:
        e = tl.load(edge + seg * HD + chan, mask=cmask, other=0.0).to(tl.float32)
        acc_s = acc_s + acc_a * e
    tl.store(out_m + seg * HD + chan, acc_a, mask=cmask)
    tl.store(out_s + seg * HD + chan, acc_s, mask=cmask)


@triton.jit
def _diag_summary_kernel(x, y, g, edge, out_m, out_s, part, T, t0, t1, chunk_rows, n_chunks,
                         HD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, REVERSE: tl.constexpr,
                         HAS_EDGE: tl.constexpr, SINGLE: tl.constexpr):
    """Context parallelism's summary of rows [t0, t1) of every batch row (a *segment*) of (B, T, H * D)
    tensors, in one read of x, y, g (``ops/diag/triton_impl.py: diag_summary``). Program (segment, chunk of
    ``chunk_rows`` rows) x block of BD channels: the chunk's (A, S) (``_summary_rows``); SINGLE (one chunk per
    segment): written with the edge term, else as a partial for ``_diag_summary_combine_kernel``."""
    pid = tl.program_id(0)
    seg = pid // n_chunks
    c = pid % n_chunks
    chan = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = chan < HD
    r0 = t0 + c * chunk_rows
    r1 = tl.minimum(r0 + chunk_rows, t1)
    acc_a, acc_s = _summary_rows(x, y, g, seg.to(tl.int64) * T * HD, r0, r1, chan, cmask, HD, BT, BD, REVERSE)
    if SINGLE:
        _summary_finish(acc_a, acc_s, edge, out_m, out_s, seg, chan, cmask, HD, REVERSE, HAS_EDGE)
    else:
        w = (seg.to(tl.int64) * n_chunks + c) * 2 * HD + chan
        tl.store(part + w, acc_a, mask=cmask)
        tl.store(part + w + HD, acc_s, mask=cmask)


@triton.jit
def _diag_summary_combine_kernel(part, edge, out_m, out_s, n_chunks, HD: tl.constexpr, BD: tl.constexpr,
                                 REVERSE: tl.constexpr, HAS_EDGE: tl.constexpr):
    """The chunks' partial (A, S) of a segment composed in time order: forward (A1, S1) then (A2, S2) is
    (A1 A2, A2 S1 + S2); REVERSE it is (A1 A2, S1 + A1 S2)."""
    seg = tl.program_id(0)
    chan = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = chan < HD
    acc_a = tl.full([BD], 1.0, tl.float32)
    acc_s = tl.zeros([BD], tl.float32)
    c = 0
    while c < n_chunks:
        w = (seg.to(tl.int64) * n_chunks + c) * 2 * HD + chan
        a = tl.load(part + w, mask=cmask, other=1.0)
        s = tl.load(part + w + HD, mask=cmask, other=0.0)
        if REVERSE:
            acc_s = acc_s + acc_a * s
        else:
            acc_s = a * acc_s + s
        acc_a = acc_a * a
        c += 1
    _summary_finish(acc_a, acc_s, edge, out_m, out_s, seg, chan, cmask, HD, REVERSE, HAS_EDGE)
