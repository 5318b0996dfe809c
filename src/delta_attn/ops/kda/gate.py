"""Shared per-chunk steps of the KDA kernels (Triton ``@jit`` helpers): the gate, the chunk-local
cumulative log decay, the chunk's rows and row norms, and their backward pieces.

* gate: the log decay of a token from its gate input, raw (``GATE`` 0), ``-exp(A_log) softplus(x)``
  (1) or ``lower_bound sigmoid(exp(A_log) x)`` (2), with ``x = g + dt_bias``;
* decay: every per-token log decay is floored at ``-DECAY_FLOOR`` (exp(-30) ~ 1e-13: a reset in
  fp32, -inf included) and summed over the chunk's rows only, so every exponent the kernels form is
  a difference of small chunk-local sums;
* rows: the (sequence, first row, length) of a chunk, its row offsets and beta; the L2 row norms
  of q and k (``use_qk_l2norm``) and their backward.
"""
from __future__ import annotations

import triton
import triton.language as tl

DECAY_FLOOR = 30.0


@triton.jit
def _kda_gate(x, a, lower_bound, GATE: tl.constexpr):
    """Log decay from the gate input: raw (0), -a*softplus(x) (1), lower_bound*sigmoid(a*x) (2)."""
    if GATE == 1:
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.where(x > 20.0, 20.0, x))))
        return -a * sp
    elif GATE == 2:
        return lower_bound * tl.sigmoid(a * x)
    else:
        return x


@triton.jit
def _kda_gate_grads(x, a, lower_bound, GATE: tl.constexpr):
    """(d decay / d x, d decay / d A_log) of ``_kda_gate``."""
    if GATE == 1:
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.where(x > 20.0, 20.0, x))))
        return -a * tl.sigmoid(x), -a * sp
    elif GATE == 2:
        s = tl.sigmoid(a * x)
        ds = lower_bound * s * (1.0 - s)
        return ds * a, ds * a * x
    else:
        return tl.full(x.shape, 1.0, tl.float32), tl.zeros(x.shape, tl.float32)


@triton.jit
def _kda_floor(d, FLOOR: tl.constexpr):
    """The log decay floored at -FLOOR. A select, not tl.maximum: on the GPU maximum(NaN, x) is x, which
    would turn a NaN gate into a finite decay (a silent reset); NaN must propagate within its sequence."""
    return tl.where(d < -FLOOR, -FLOOR, d)


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
    return x, d, tl.cumsum(tl.where(mask, _kda_floor(d, FLOOR), 0.0), 0)


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
def _kda_row_at(G, i, r):
    """Row r of a (rows x cols) tile, as a cols vector."""
    return tl.sum(tl.where(i[:, None] == r, G, 0.0), 0)


@triton.jit
def _kda_row_norms_sliced(q, k, q_off, mr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          L2NORM: tl.constexpr):
    """Inverse L2 norms (nq, nk) of the BT rows of q and k (ones without L2NORM), K slice by K slice."""
    nq = tl.full([BT], 1.0, tl.float32)
    nk = tl.full([BT], 1.0, tl.float32)
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
        nq = 1.0 / tl.sqrt(sq + 1e-6)
        nk = 1.0 / tl.sqrt(sk + 1e-6)
    return nq, nk


@triton.jit
def _kda_round_tf32(x):
    """x rounded to the nearest tf32 value (10-bit mantissa), kept in fp32: exact tf32 MMA operands."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)

