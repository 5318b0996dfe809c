"""Decode stage of KDA (Triton, and Gluon on CUDA): a few new tokens per sequence from a state pool, updated
in place.

One program per (V block, sequence, value head): the fp32 state block S (K x BV) is read once from its
start slot (``ops/_slots.py``: ``state_indices`` (B,) or, speculative, (B, T) with ``num_accepted_tokens``)
and kept in registers while the program walks the T tokens; per token:
  1. decay ``S <- exp(g) S``;
  2. both reductions over K from the decayed S, in one pass: ``p = S^T k`` and ``r = S^T (scale q)``;
  3. correction ``u = beta (v - p)`` and read-out ``o = r + (k . scale q) u`` (= ``(S + k u^T)^T scale q``,
     so the read-out needs no second pass over the updated S);
  4. write ``S <- S + k u^T``, stored to the token's slot with (B, T) indices.
Without (B, T) indices S is stored once, to the start slot, after the last token. Plain fp32 FMA
arithmetic: fp32-accurate for every input dtype. ``EVEN`` (K == KP and V % BV == 0) drops the masks.

Two kernels run the one program (``_kda_step_program``): the Gluon kernel on CUDA gives the block an explicit
register layout in which q, k, g and v load straight into the slices the step broadcasts and reduces along
(7 % faster at 64 sequences on the H200, 3 % at 256-1024); the Triton kernel lets Triton choose, for the CPU
interpreter and Tritons without Gluon (``ops/_gluon.py``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._gluon import gl, gluon
from .._slots import _start_slot, _token_slot
from .._triton_helpers import _ld, _st
from .kernels_gate import _kda_gate


@triton.jit
def _kda_step_token(q, k, v, g, beta, S, idx, O, st, a, bias, bi, hv, h, t, kk, mk, vv, mv, ms, in_slot,
                    scale, lower_bound, T, H, HV, K: tl.constexpr, V: tl.constexpr, L2NORM: tl.constexpr,
                    GATE: tl.constexpr, IDX: tl.constexpr, EVEN: tl.constexpr):
    """Token t of sequence bi on the state block ``st`` (fp32, K x BV columns ``vv`` of value head hv): stores
    its output (and, with (B, T) slots, the state after it); returns the updated block."""
    row = bi * T + t
    # 0. the token's inputs, all issued before any arithmetic waits on one of them
    qv = tl.load(q + (row * H + h) * K + kk, mask=mk, other=0.0).to(tl.float32)
    kv = tl.load(k + (row * H + h) * K + kk, mask=mk, other=0.0).to(tl.float32)
    x = tl.load(g + (row * HV + hv) * K + kk, mask=mk, other=0.0).to(tl.float32) + bias
    b = tl.load(beta + row * HV + hv).to(tl.float32)
    vt = _ld(v + (row * HV + hv) * V + vv, mv, EVEN).to(tl.float32)
    if L2NORM:
        qv = qv / tl.sqrt(tl.sum(qv * qv, 0) + 1e-6)
        kv = kv / tl.sqrt(tl.sum(kv * kv, 0) + 1e-6)
    qv = qv * scale
    d = _kda_gate(x, a, lower_bound, GATE)
    # 1. decay; 2. both reductions over K; 3. correction and read-out; 4. delta-rule write
    st = st * tl.exp(d)[:, None]
    p = tl.sum(st * kv[:, None], 0)
    r = tl.sum(st * qv[:, None], 0)
    u = b * (vt - p)
    o = r + tl.sum(kv * qv, 0) * u
    st = st + kv[:, None] * u[None, :]
    _st(O + (row * HV + hv) * V + vv, o.to(O.dtype.element_ty), mv, EVEN)
    if IDX == 2:
        _st(S + _token_slot(idx, bi, T, t) * (HV * K * V) + in_slot, st.to(S.dtype.element_ty), ms, EVEN)
    return st


@triton.jit
def _kda_step_program(q, k, v, g, beta, A_log, dt_bias, S, idx, nat, O, scale, lower_bound, T, H, HV, kk, vv,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
                      HAS_DT_BIAS: tl.constexpr, IDX: tl.constexpr, HAS_NAT: tl.constexpr, EVEN: tl.constexpr):
    """One program: the state block's rows ``kk`` (0 .. KP) and columns ``vv`` (0 .. BV, before the block
    offset), in whichever register layout the kernel gave them; every tensor of the step derives from them."""
    iv = tl.program_id(0)
    bi = tl.program_id(1).to(tl.int64)
    hv = tl.program_id(2).to(tl.int64)
    h = hv // (HV // H)
    vv = iv * BV + vv
    mk = kk < K
    mv = vv < V
    ms = mk[:, None] & mv[None, :]
    in_slot = (hv * K + kk[:, None]) * V + vv[None, :]         # the block's offsets inside one slot
    slot_size = HV * K * V
    s_start = S + _start_slot(idx, nat, bi, T, IDX, HAS_NAT) * slot_size + in_slot
    st = _ld(s_start, ms, EVEN).to(tl.float32)
    a = 1.0
    if GATE != 0:
        a = tl.exp(tl.load(A_log + hv).to(tl.float32))
    bias = kk.to(tl.float32) * 0.0                            # zeros, in the layout of kk
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + hv * K + kk, mask=mk, other=0.0).to(tl.float32)
    for t in range(0, T):
        st = _kda_step_token(q, k, v, g, beta, S, idx, O, st, a, bias, bi, hv, h, t, kk, mk, vv, mv, ms, in_slot,
                             scale, lower_bound, T, H, HV, K, V, L2NORM, GATE, IDX, EVEN)
    if IDX != 2:
        _st(s_start, st.to(S.dtype.element_ty), ms, EVEN)


@triton.jit
def _kda_step_kernel(q, k, v, g, beta, A_log, dt_bias, S, idx, nat, O,
                     scale, lower_bound, T, H, HV,
                     K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
                     L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                     IDX: tl.constexpr, HAS_NAT: tl.constexpr, EVEN: tl.constexpr):
    """Triton lays out the registers (the CPU interpreter, and GPUs without Gluon)."""
    _kda_step_program(q, k, v, g, beta, A_log, dt_bias, S, idx, nat, O, scale, lower_bound, T, H, HV,
                      tl.arange(0, KP), tl.arange(0, BV), K, V, BV, L2NORM, GATE, HAS_DT_BIAS, IDX, HAS_NAT, EVEN)


if gluon is not None:
    @gluon.jit
    def _kda_step_kernel_gluon(q, k, v, g, beta, A_log, dt_bias, S, idx, nat, O,
                               scale, lower_bound, T, H, HV,
                               K: gl.constexpr, V: gl.constexpr, KP: gl.constexpr, BV: gl.constexpr,
                               L2NORM: gl.constexpr, GATE: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
                               IDX: gl.constexpr, HAS_NAT: gl.constexpr, EVEN: gl.constexpr, LAYOUT: gl.constexpr):
        """The same program with the state block in ``LAYOUT`` (:func:`step_layout`) and q, k, g, v loaded
        straight into its row / column slices: no register layout conversion between the loads and the
        reductions (Triton's own choice converts q, k, the decay and v through shared memory)."""
        _kda_step_program(q, k, v, g, beta, A_log, dt_bias, S, idx, nat, O, scale, lower_bound, T, H, HV,
                          gl.arange(0, KP, layout=gl.SliceLayout(1, LAYOUT)),
                          gl.arange(0, BV, layout=gl.SliceLayout(0, LAYOUT)),
                          K, V, BV, L2NORM, GATE, HAS_DT_BIAS, IDX, HAS_NAT, EVEN)
else:
    _kda_step_kernel_gluon = None


def step_layout(BV: int, num_warps: int, state_bytes: int):
    """The state block's register layout for the Gluon kernel: 16-byte vectors along V (the contiguous axis),
    the warp's remaining lanes along K, warps along K (Triton's own choice for this block, measured fastest
    of 8 layouts on the H200 at 64-1024 sequences)."""
    vec = max(1, min(16 // state_bytes, BV))
    lanes_v = min(BV // vec, 32)
    return gl.BlockedLayout([1, vec], [32 // lanes_v, lanes_v], [num_warps, 1], [1, 0])
