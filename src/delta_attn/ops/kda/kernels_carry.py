"""Context parallelism's carry terms (Triton): what the carry S adds to a pass that started the carried rows
from state 0, and the carry's gradient.

The state scan is linear in its initial state, so every quantity a pass computes from the carried rows is
``X(S) = X(0) + Y S`` with Y that of the transition's scan (``launch.transition_scan``): the outputs (Y = u),
the training forward's u (``VNEW``) and chunk-start states (``HS``). ``_kda_carry_add_kernel`` adds
``Y S`` in place, in fp32; ``_kda_carry_grad_kernel`` forms the carry's gradient from the outputs,
``sum_t Y_t^T dX_t``, in row splits whose partial sums the launcher adds.

Both address X and Y as blocks b of rows r with a head h, ``X[b, h, r, :]`` at ``b X_B + h X_H + r X_R`` (unit
last stride), so one kernel serves row tensors (B, T, HV, .) and per-chunk states (chunks, HV, K, .); the
carry of block b is ``S[b // NPS]`` (NPS: blocks per carried row).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kda_carry_add_kernel(X, Y, S, NR, NPS, HV, X_B, X_H, X_R, Y_B, Y_H, Y_R,
                          K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr,
                          BV: tl.constexpr, PREC: tl.constexpr):
    """X[b, h, r, v] += sum_k Y[b, h, r, k] S[b // NPS, h, k, v] for rows r < NR; grid (row blocks, blocks x HV,
    V blocks); S (carried rows, HV, K, V) fp32."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HV
    h = bh % HV
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    kk = tl.arange(0, KP)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    mr = r < NR
    mk = kk < K
    mv = vv < V
    y = tl.load(Y + b * Y_B + h * Y_H + r[:, None] * Y_R + kk[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
    s = tl.load(S + ((b // NPS) * HV + h) * K * V + kk[:, None] * V + vv[None, :], mask=mk[:, None] & mv[None, :],
                other=0.0)
    x_ptr = X + b * X_B + h * X_H + r[:, None] * X_R + vv[None, :]
    m = mr[:, None] & mv[None, :]
    x = tl.load(x_ptr, mask=m, other=0.0).to(tl.float32)
    x += tl.dot(y.to(tl.float32), s, input_precision=PREC)
    tl.store(x_ptr, x.to(X.dtype.element_ty), mask=m)


@triton.jit
def _kda_carry_grad_kernel(Y, DX, DS, NR, RPS, NB, HV, Y_B, Y_H, Y_R, X_B, X_H, X_R,
                           K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr,
                           BV: tl.constexpr, PREC: tl.constexpr):
    """DS[p, b, h] = sum_r Y[b, h, r]^T DX[b, h, r] over the rows [p RPS, (p + 1) RPS) of split p (r < NR); grid
    (splits, blocks x HV, V blocks); DS (splits, NB, HV, K, V) fp32."""
    p = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HV
    h = bh % HV
    kk = tl.arange(0, KP)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    end = tl.minimum(NR, (p + 1) * RPS)
    acc = tl.zeros([KP, BV], tl.float32)
    for r0 in range(p * RPS, end, BR):
        r = (r0 + tl.arange(0, BR)).to(tl.int64)
        mr = r < end
        y = tl.load(Y + b * Y_B + h * Y_H + r[:, None] * Y_R + kk[None, :], mask=mr[:, None] & mk[None, :],
                    other=0.0)
        dx = tl.load(DX + b * X_B + h * X_H + r[:, None] * X_R + vv[None, :], mask=mr[:, None] & mv[None, :],
                     other=0.0)
        acc += tl.dot(tl.trans(y.to(tl.float32)), dx.to(tl.float32), input_precision=PREC)
    tl.store(DS + ((p * NB + b) * HV + h) * K * V + kk[:, None] * V + vv[None, :], acc, mask=mk[:, None] & mv[None, :])
