"""Context-parallel gated diagonal attention: exchange first, then one pass at the true initial state.

Per channel the state is a scalar, ``s_t = exp(g_t) s_{t-1} + k_t v_t``, so the state after a piece is
``S_out = M S_in + B`` with M = prod exp(g) (the decay product) and B the state from 0. Schedule (rank r,
docs/DISTRIBUTED.md derives its memory traffic):

forward
  1. summary of the last piece (what this rank hands on, only where the plan says it hands one on): one
     read of k, v, g over that piece (``ops/diag/launch.py: diag_summary``) gives M and B (from the
     piece's own initial state when it starts on this rank);
  2. exchange (``_carry.py``): the carry into this rank's first piece;
  3. the single-GPU forward once, at the true initial state of every piece (the carry for the first one):
     o and the final states, nothing to correct.
backward (the mirror)
  1. summary of the first piece (only on ranks that take a carry): one read of q, do, g gives the gradient
     of the carry from this rank's own work, ``dc = sum_t exp(g_1 + .. + g_t) q_t do_t + M dS_end``;
  2. exchange in reverse: dX, the gradient of the state this rank hands on;
  3. the single-GPU backward once, with dX added to the last piece's final-state gradient. It gives every
     gradient: the summaries' M and B enter the rest only through ``M c + B``, the state the main pass
     computed at the end of that piece, so their gradient is exactly that of the final state.

Nothing the size of the inputs is copied, concatenated or saved beyond what the single-GPU operator saves
(q, k, v, g, its workspace of carries); the summaries and the exchange are (rows, H, D) each.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks as C
from ..ops.diag import api as diag_api
from ..reference import accumulation_dtype
from ._carry import Affine, carry, carry_grad
from .linear import distribute_finals, initial_rows, num_states, setup
from .plan import LinearPlan, Plan, value_checks
from . import _comm

DIAG_MAP = Affine(matrix=False)


class _Local:
    """The single-GPU pieces on one backend: ``"triton"`` runs the kernels (the summary kernel, the
    forward / backward scans); any other backend runs the operator itself (the backward recomputes it under
    autograd) and the summaries in torch (the float64 reference path)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.kernels = backend == "triton"
        if self.kernels:
            from ..ops.diag import autograd  # noqa: F401  (registers torch.ops.delta_attn.diag_*)

    def summary(self, x, y, g, t0: int, t1: int, edge, reverse: bool, sdt):
        """``(decay product, S)`` (rows, H, D) of rows [t0, t1): see ``ops/diag/launch.diag_summary``."""
        if self.kernels:
            from ..ops.diag import launch
            return launch.diag_summary(x, y, g, t0, t1, edge, reverse)
        xs, ys, gs = (t[:, t0:t1].to(sdt) for t in (x, y, g))
        decay = gs.sum(1).exp()
        if reverse:       # exp of the inclusive prefix sums
            s = (gs.cumsum(1).exp() * xs * ys).sum(1)
        else:             # exp of the exclusive suffix sums (a cumsum over the reversed tail: no differences)
            tail = gs[:, 1:].flip(1).cumsum(1).flip(1)
            s = (torch.cat([tail, torch.zeros_like(gs[:, :1])], 1).exp() * xs * ys).sum(1)
        if edge is not None:
            s = s + decay * edge.to(sdt)
        return decay, s

    def forward(self, q, k, v, g, init, cu, need_final: bool, training: bool):
        """``(o, finals or None, saved)`` with the true initial states ``init``."""
        if self.kernels:
            o, f, ws = torch.ops.delta_attn.diag_fwd(q, k, v, g, init, cu, need_final, training)
            return o, (f if need_final else None), (ws,)
        with torch.no_grad(), C.values_checked():
            o, f = diag_api.gated_diag_attn(q, k, v, g, initial_state=init, output_final_state=need_final,
                                            cu_seqlens=cu, backend=self.backend)
        return o, f, ()

    def backward(self, q, k, v, g, init, cu, saved, do, dfinal):
        """``(dq, dk, dv, dg, d init or None)``; ``dfinal`` (rows, H, D) or None."""
        if self.kernels:
            dq, dk, dv, dg, dh0 = torch.ops.delta_attn.diag_bwd(q, k, v, g, do, saved[0], init, dfinal, cu)
            return dq, dk, dv, dg, (dh0 if init is not None else None)
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]
        h = None if init is None else init.detach().requires_grad_()
        with torch.enable_grad(), C.values_checked():
            o, f = diag_api.gated_diag_attn(*leaves, initial_state=h, output_final_state=dfinal is not None,
                                            cu_seqlens=cu, backend=self.backend)
            outs, grads = [o], [do]
            if dfinal is not None:
                outs.append(f)
                grads.append(dfinal.to(f.dtype))
            got = torch.autograd.grad(outs, leaves + ([h] if h is not None else []), grads, allow_unused=True)
        got = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves + [h], got)]
        return tuple(got[:4]) + ((got[4] if h is not None else None),)


class _Run:
    """Everything but the tensors: the plan, the backend, the exchange, the state dtype."""

    def __init__(self, lp: LinearPlan, local: _Local, scheme: str, group, need_final: bool, sdt):
        self.lp, self.local, self.scheme, self.group, self.need_final, self.sdt = (
            lp, local, scheme, group, need_final, sdt)


class _DiagCP(torch.autograd.Function):
    """(q, k, v, g, initial_state) -> (o, the local final state of every row / piece); the schedule of the
    module docstring, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, run: _Run):
        lp, local, r = run.lp, run.local, run.lp.rank
        rows, h, d = q.shape[0], q.shape[2], q.shape[3]
        # 1. the summary this rank hands on (its last piece; from the piece's own initial state if it starts here)
        if lp.hands_on[r]:
            edge = None
            if not lp.passes[r] and h0 is not None:
                edge = h0 if not lp.varlen else h0.index_select(0, lp.seq[-1:])
            m, b = local.summary(k, v, g, lp.last_start, q.shape[1], edge, False, run.sdt)
        else:
            m = b = q.new_zeros((rows, h, d), dtype=run.sdt)
        # 2. the carry into the first piece
        c, ms = carry(lp, DIAG_MAP, m, b, run.scheme, run.group)
        # 3. one pass at the true initial states
        init = initial_rows(lp, h0, c)
        training = any(ctx.needs_input_grad[:5])
        o, f, saved = local.forward(q, k, v, g, init, lp.cu_local, run.need_final, training)
        ctx.run, ctx.ms, ctx.h0_dtype = run, ms, None if h0 is None else h0.dtype
        ctx.save_for_backward(q, k, v, g, init, m, *saved)
        if f is None:
            f = q.new_empty((0,), dtype=run.sdt)
            ctx.mark_non_differentiable(f)
        return o, f

    @staticmethod
    def backward(ctx, do, dfinal):
        run = ctx.run
        lp, local, r = run.lp, run.local, run.lp.rank
        q, k, v, g, init, m, *saved = ctx.saved_tensors
        if not run.need_final:
            dfinal = None
        # 1. this rank's own gradient of its carry (its first piece, from its own outputs and final state)
        dc = None
        if lp.cont[r]:
            edge = None if dfinal is None else (dfinal[:1] if lp.varlen else dfinal)
            _, dc = local.summary(q, do, g, 0, lp.first_len, edge, True, run.sdt)
        # 2. the gradient of the state this rank hands on
        dx = carry_grad(lp, DIAG_MAP, m, ctx.ms, dc, m, run.scheme, run.group)
        # 3. one backward, dX joining the last piece's final-state gradient
        if dx is not None:
            if dfinal is None:
                n = lp.n_pieces if lp.varlen else q.shape[0]
                dfinal = dx.new_zeros((n,) + tuple(dx.shape[1:]))
            else:
                dfinal = dfinal.to(dx.dtype, copy=True)
            if lp.varlen:
                dfinal[-1:] += dx
            else:
                dfinal += dx
        dq, dk, dv, dg, dinit = local.backward(q, k, v, g, init, lp.cu_local, saved, do, dfinal)
        # 4. initial_state: the rows of the pieces that start on this rank (the carried one is not an input)
        dh0 = None
        if ctx.h0_dtype is not None and ctx.needs_input_grad[4] and dinit is not None:
            if not lp.varlen:
                dh0 = None if lp.cont[r] else dinit
            else:
                first = 1 if lp.cont[r] else 0
                dh0 = torch.zeros((lp.n_seq,) + tuple(dinit.shape[1:]), dtype=ctx.h0_dtype, device=dinit.device)
                dh0.index_add_(0, lp.seq[first:], dinit[first:].to(ctx.h0_dtype))
        return dq, dk, dv, dg, dh0, None


def _backend(q, k, v, g, cu, backend: str) -> str:
    """The backend the single-GPU operator would run this shard on (its dispatcher's choice)."""
    with C.values_checked():
        chosen = diag_api.gated_diag_attn.plan(q, k, v, g, output_final_state=True, cu_seqlens=cu,
                                               backend=backend).chosen
        if chosen is None:          # none takes it: the operator raises why
            diag_api.gated_diag_attn(q, k, v, g, cu_seqlens=cu, backend=backend)
    return chosen


def gated_diag_attn(q, k, v, g, *, group=None, state_passing: str = "allgather", initial_state=None,
                    output_final_state=False, cu_seqlens=None, backend="auto", plan: Optional[Plan] = None):
    """Context-parallel :func:`delta_attn.gated_diag_attn` on this rank's shards of dim 1 (see :func:`kda`
    for the layout, ``cu_seqlens``, ``initial_state``, gradients, ``state_passing`` and ``plan``). g is a log
    decay <= 0, as in :func:`delta_attn.gated_diag_attn`."""
    with value_checks(plan):
        diag_api.validate(q, k, v, g, None, output_final_state, None)
    lp = setup("dd.gated_diag_attn", q, cu_seqlens, group, state_passing, plan)
    C.state("initial_state", initial_state, (num_states(lp, q),) + tuple(q.shape[2:]), q.device, "(N, H, D) float32")
    run = _Run(lp, _Local(_backend(q, k, v, g, lp.cu_local, backend)), state_passing, group, output_final_state,
               accumulation_dtype(q.dtype))
    o, f = _DiagCP.apply(q, k, v, g, initial_state, run)
    if not output_final_state:
        return o, None
    final = distribute_finals(lp, f, initial_state, group)
    return _comm.tie(o, final), final
