"""Triton kernel of the gated diagonal decode step (``gated_diag_step``): the recurrence
``s_t = exp(g_t) * s_{t-1} + k_t * v_t``, ``o_t = q_t * s_t`` token by token on a state pool, in place; a program
owns a block of the flattened H * D channels of one sequence (``ops/_slots.py`` gives its slots).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._slots import _start_slot, _token_slot
from .._triton_helpers import _ld, _st


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
