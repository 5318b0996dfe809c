"""Context parallelism's summary of gated diagonal attention (Triton; used by ``delta_attn/distributed/diag.py``).

Per channel of rows [t0, t1) of every batch row, the decay product and the state from 0 (forward: one read of
k, v, g) or the gradient of the state before the rows (reverse: one read of q, do, g), with an edge term (the
rows' initial state, or the final state's gradient). Programs own chunks of rows (``_diag_summary_kernel``),
composed in time order by a second launch when there are several (``_diag_summary_combine_kernel``).
"""
from __future__ import annotations

import triton
import triton.language as tl


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
    tensors, in one read of x, y, g (``ops/diag/launch.py: diag_summary``). Program (segment, chunk of
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
