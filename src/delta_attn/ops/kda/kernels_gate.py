"""Shared per-chunk steps of the KDA kernels (Triton ``@jit`` helpers): the gate, the chunk-local
cumulative log decay, the chunk's rows and row norms, and their backward pieces.

* gate: the log decay of a token from its gate input, raw (``GATE`` 0), ``-exp(A_log) softplus(x)``
  (1) or ``lower_bound sigmoid(exp(A_log) x)`` (2), with ``x = g + dt_bias``;
* decay: every per-token log decay is floored at ``-DECAY_FLOOR`` (exp(-30) ~ 1e-13: a reset in
  fp32, -inf included) and summed over the chunk's rows only, so every exponent the kernels form is
  a difference of chunk-local sums (kept in two floats for fp32 inputs: ``_kda_cumsum``);
* rows: the (sequence, first row, length) of a chunk, its row offsets and beta; the L2 row norms
  of q and k (``use_qk_l2norm``) and their backward.

Two named structures (Triton aggregates) carry what every per-chunk kernel forms first and passes on:
``KdaChunkRows`` (``_kda_chunk_rows``: the chunk's rows for one value head) and ``KdaGate``
(``_kda_head_gate``: the value head's gate inputs).
"""
# No ``from __future__ import annotations`` here: Triton 3.6's aggregate checks each field with ``isinstance``
# against the class annotation, which must then be a type, not a string.

import triton
import triton.language as tl
from triton.language.core import _aggregate as aggregate    # triton.aggregate in Triton >= 3.7; here from 3.6 on

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


@aggregate
class KdaGate:
    """The gate of one value head (``_kda_head_gate``): the gate input ``g`` and ``dt_bias`` (pointers; dt_bias
    read only with ``HAS_DT_BIAS``), ``a = exp(A_log[hv])`` (1 without a gate) and ``lower_bound`` (fp32)."""
    g: tl.tensor
    dt_bias: tl.tensor
    a: tl.tensor
    lower_bound: tl.tensor

    @triton.constexpr_function
    def __init__(self, g, dt_bias, a, lower_bound):
        self.g = g
        self.dt_bias = dt_bias
        self.a = a
        self.lower_bound = lower_bound


@triton.jit
def _kda_head_gate(g, dt_bias, A_log, lower_bound, hv, GATE: tl.constexpr):
    """The ``KdaGate`` of value head hv."""
    a = tl.full([], 1.0, tl.float32)        # read by the gate only when GATE != 0
    if GATE != 0:
        a = tl.exp(tl.load(A_log + hv).to(tl.float32))
    return KdaGate(g, dt_bias, a, tl.cast(lower_bound, tl.float32))   # the cast: a tensor in the interpreter too


@triton.jit
def _kda_load_decay(gate, g_off, hv, cols, mask, K: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """Gate input x and the log decay d (fp32, before the floor) of one (rows x cols) tile (``gate``: a KdaGate)."""
    x = tl.load(gate.g + g_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        x += tl.load(gate.dt_bias + hv * K + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
    d = _kda_gate(x, gate.a, gate.lower_bound, GATE)
    return x, d


DECAY_GRID = tl.constexpr(4096.0)    # 2^12: the grid of the high parts of the two-float cumulative sum (_kda_cumsum)


@triton.jit
def _kda_cumsum(df, FLOOR: tl.constexpr, TWO_FLOAT: tl.constexpr):
    """The cumulative sum over rows of the floored log decays df (in [-FLOOR, 0]): (G, Gl). With
    ``TWO_FLOAT``, G + Gl is the sum in two floats (G the fp32 sum, Gl what its rounding dropped), else G is
    the plain fp32 sum and Gl = 0 (unused, compiled out).

    Why two floats for fp32 inputs: over a 64-token chunk G reaches hundreds (floored decays of -30 at a
    few tokens, or a gate of -5 at every token), where fp32 holds G only to ~3e-5 absolute, and an exponent
    G_i - G_j formed from two such values carries that error: a 3e-5 relative error of exp(G_i - G_j) even
    when the difference is small (enough to put fp32 gradients over the error rule: docs/PERFORMANCE.md,
    "fp32 with exact dots"). The exponents are formed by
    ``_kda_gdiff`` / ``_kda_rel`` from both parts instead, accurate to the rounding of the difference.

    How: df = dh + dl with dh = df rounded down to the 2^-12 grid, so every partial sum of dh is exact in
    fp32 (|G| <= rows x FLOOR < 2^12) and those of dl (each in [0, 2^-12)) lose < 1e-7; two plain
    cumulative sums, then a two-sum splits their total into G + Gl."""
    if TWO_FLOAT:
        tl.static_assert(df.shape[0] * FLOOR < DECAY_GRID, "exact high parts need |G| < 2^12")
        dh = tl.floor(df * DECAY_GRID) * (1.0 / DECAY_GRID)
        Gh = tl.cumsum(dh, 0)
        Gs = tl.cumsum(df - dh, 0)
        G = Gh + Gs
        bv = G - Gh
        Gl = (Gh - (G - bv)) + (Gs - bv)
    else:
        G = tl.cumsum(df, 0)
        Gl = tl.zeros_like(G)
    return G, Gl


@triton.jit
def _kda_tangent(t, d, mask, FLOOR: tl.constexpr):
    """A tangent of the floored log decay (t = d decay / d parameter): 0 where the floor holds the decay
    (d < -FLOOR: a select, so a NaN gate stays NaN, as ``_kda_floor``) and on masked rows."""
    return tl.where(mask, tl.where(d < -FLOOR, 0.0, t), 0.0)


@triton.jit
def _kda_tangent_sum(W, Wl, dGo, kdd, end, i, L, TWO_FLOAT: tl.constexpr):
    """Per channel, sum_t w_t dd_t over a chunk: the gradient of a gate parameter (A_log: w = d decay / d A_log,
    dt_bias: w = d decay / d x, per channel) from the per-token log-decay gradients dd, without the pair terms of
    dG (the caller adds them: ``_kda_tangent_pairs``). W + Wl is the cumulative tangent (``_kda_cumsum`` of w).

    dd_t = sum_{i >= t} dG_i + sum_{s < t} kdd_s + end (the backward's reverse cumulative sum, with
    end = exp(G_last) dgc), so sum_t w_t dd_t = sum_i W_i dG_i + sum_s kdd_s (W_last - W_s) + W_last end. Formed
    this way, every weight multiplies a term that carries the decay over the same tokens (exp(G_i) with W_i,
    exp(G_last - G_s) with W_last - W_s): the products stay bounded. Summing w_t dd_t instead weights the
    rounding of every dG_i by the cumulative W_i, hundreds over a strongly decaying chunk (fp32 dA_log up to 5x
    over the error rule on CPU fuzz seeds, d dt_bias up to 1.2x; tests/ops/test_kda_triton.py::
    test_gate_parameter_gradients_strong_decay). dGo: the terms of dG other than the pairs (0 on masked rows)."""
    W_last = _kda_row_at(W, i, L - 1)
    return tl.sum(W * dGo, 0) - tl.sum(kdd * _kda_rel(W, Wl, i, L - 1, TWO_FLOAT), 0) + W_last * end


@triton.jit
def _kda_gdiff(Ga, La, Gb, Lb, TWO_FLOAT: tl.constexpr):
    """The exponent G_a - G_b of two cumulative log decays given as hi + lo (``_kda_cumsum``): the high
    parts' difference (exact when they are within a factor 2 of each other) plus the low parts'."""
    if TWO_FLOAT:
        return (Ga - Gb) + (La - Lb)
    else:
        return Ga - Gb


@triton.jit
def _kda_rel(G, Gl, i, r, TWO_FLOAT: tl.constexpr):
    """G - G[row r] (a rows x cols tile relative to one of its rows), from both parts as ``_kda_gdiff``."""
    return _kda_gdiff(G, Gl, _kda_row_at(G, i, r)[None, :], _kda_row_at(Gl, i, r)[None, :], TWO_FLOAT)


@triton.jit
def _kda_chunk_decay(gate, g_off, hv, cols, mask, K: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                     FLOOR: tl.constexpr, TWO_FLOAT: tl.constexpr):
    """``_kda_load_decay`` and G, the log decay floored at -FLOOR and summed over the chunk's rows up to
    each row (0 on masked rows), as G + Gl (``_kda_cumsum``): (x, d, G, Gl)."""
    x, d = _kda_load_decay(gate, g_off, hv, cols, mask, K, GATE, HAS_DT_BIAS)
    G, Gl = _kda_cumsum(tl.where(mask, _kda_floor(d, FLOOR), 0.0), FLOOR, TWO_FLOAT)
    return x, d, G, Gl


@aggregate
class KdaChunkRows:
    """The rows of one chunk for one value head (``_kda_chunk_rows``): the value head ``hv``, the chunk's length
    ``L``, the row index ``i`` (0 .. BT - 1), its mask ``mr`` (i < L), the packed ``rows``, the row offsets of
    q / k (``q_off``, at the q / k head hv // (HV // H)), of g and the K-wide operands (``g_off``) and of v and the
    V-wide ones (``v_off``), all (BT, 1), and beta of each row (``b``, fp32, 0 on masked rows)."""
    hv: tl.tensor
    L: tl.tensor
    i: tl.tensor
    mr: tl.tensor
    rows: tl.tensor
    q_off: tl.tensor
    g_off: tl.tensor
    v_off: tl.tensor
    b: tl.tensor

    @triton.constexpr_function
    def __init__(self, hv, L, i, mr, rows, q_off, g_off, v_off, b):
        self.hv = hv
        self.L = L
        self.i = i
        self.mr = mr
        self.rows = rows
        self.q_off = q_off
        self.g_off = g_off
        self.v_off = v_off
        self.b = b


@triton.jit
def _kda_chunk_rows(chunk_info, beta, c, hv, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """The ``KdaChunkRows`` of chunk c for value head hv (chunk_info: (sequence, first row, length) per chunk)."""
    h = hv // (HV // H)
    row0 = tl.load(chunk_info + c * 3 + 1).to(tl.int64)
    L = tl.load(chunk_info + c * 3 + 2)
    i = tl.arange(0, BT)
    mr = i < L
    rows = row0 + i
    q_off = (rows * H + h)[:, None] * K
    g_off = (rows * HV + hv)[:, None] * K
    v_off = (rows * HV + hv)[:, None] * V
    b = tl.load(beta + rows * HV + hv, mask=mr, other=0.0).to(tl.float32)
    return KdaChunkRows(hv, L, i, mr, rows, q_off, g_off, v_off, b)


@triton.jit
def _kda_l2norm_bwd_rows(q, k, DQ, DK, DQO, DKO, q_off, g_off, mr, nq, rk, dotq, dotk, K: tl.constexpr,
                         BK: tl.constexpr):
    """L2-norm backward of a chunk's rows: dx = r (dy - y (y . dy)) with y = r x, where DQ / DK hold r * dy so far
    (fp32) and dotq / dotk the row sums of (r * dy) * x; nq, rk are the rows' 1 / |x|. dx goes to DQO / DKO, in
    their dtype."""
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
        tl.store(DQO + g_off + cols[None, :], gq, mask=m)
        tl.store(DKO + g_off + cols[None, :], gk, mask=m)


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

