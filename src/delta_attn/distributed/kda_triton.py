"""Context-parallel KDA on the Triton kernels: the chunk-local work once, at the true value width, one autograd node.

The state after a shard is affine in the state before it, ``S_out = M S_in + B``, and so is everything the state
scan computes: rows started from 0 are corrected by terms linear in the carry. Schedule (rank r; the carried
rows are those whose first token continues a sequence from rank r - 1: the first piece, packed; every row,
dense):

forward
  1. local pass (``ops/kda/launch_carry.py: cp_forward``): the intra-chunk stage once, on the V value columns; the
     state scan of every row (the carried ones from 0): o(0) and the final states B; where r takes a carry,
     the transition's scan of the carried rows on the same operands (no values, the identity as initial
     state, K columns): u with ``o_t = o_t(0) + u_t S_in`` and M;
  2. exchange (``_carry.py``): the summary (M, B) of the last row out, the carry S_in in;
  3. the carry folded in, in place (``cp_fold_carry``): ``o += u S_in``, ``B += M S_in`` and, training, the
     saved v_new and chunk-start states of the carried rows, so what the backward keeps is what the
     single-GPU forward at the true initial state keeps, plus u (the carried rows x K) for backward step 1.
backward
  1. the gradient of the carry from this rank's own work (where r takes a carry):
     ``dc = sum_t u_t^T do_t + M^T dS_end`` (``cp_carry_grad``);
  2. exchange in reverse: dX, the gradient of the state r hands on;
  3. the single-GPU backward once (``train_backward``), dX added to the last row's final-state gradient: every
     gradient. M and B enter the rest only through ``M S_in + B``, the final state the forward computed for that
     row, so their gradient is that of this final state (as the diagonal operator's, ``diag.py``).

Every call takes its chunk tables from the plan (``LinearPlan.kda_chunks``): no host synchronisation.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.kda import launch as kda_launch
from ..ops.kda import launch_carry
from ..ops.kda.args import KDAArgs
from ._carry import KDA_MAP, carry, carry_grad
from .plan import LinearPlan


class _Run:
    """Everything but the tensors: the validated call's options, the plan, the exchange."""

    def __init__(self, a: KDAArgs, lp: LinearPlan, scheme: str, group, need_final: bool, train: bool):
        self.scale, self.lower_bound = float(a.scale), a.lower_bound
        self.use_qk_l2norm, self.allow_tf32 = bool(a.use_qk_l2norm), bool(a.allow_tf32)
        self.lp, self.scheme, self.group, self.need_final, self.train = lp, scheme, group, need_final, train
        self.batch = a.q.shape[0]
        # the carried rows: every batch row (dense), the first piece (packed); none when r takes no carry
        self.carried = (1 if lp.varlen else self.batch) if lp.cont[lp.rank] else 0

    def chunks(self, bt: int):
        return self.lp.kda_chunks(self.batch, bt)

    def carry_shape(self, q, v):
        return (1 if self.lp.varlen else self.batch, v.shape[2], q.shape[3], v.shape[3])


class _KDATritonCP(torch.autograd.Function):
    """(q, k, v, g, beta, init, A_log, dt_bias) -> (o, the local final state of every row / piece); ``init`` the
    initial state of every local row (0 for the carried ones: ``linear.initial_rows``) or None. The schedule of the
    module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, init, A_log, dt_bias, run: _Run):
        lp, r = run.lp, run.lp.rank
        # 1. local pass: every row from its own initial state, the carried rows from 0, and their transition
        o, finals, saved, tr = launch_carry.cp_forward(
            q, k, v, g, beta, init, lp.cu_local, A_log, dt_bias, run.scale, run.lower_bound, run.use_qk_l2norm,
            run.allow_tf32, run.train, run.chunks, run.carried, lp.first_len)
        # 2. exchange: the last row's summary (its transition only where one sequence runs through the shard)
        last = finals[-1:] if lp.varlen else finals
        m = tr.m if lp.passes[r] else last.new_zeros(last.shape[:-1] + (q.shape[3],))
        c, ms = carry(lp, KDA_MAP, m, last, run.scheme, run.group)
        # 3. the carry folded into the outputs, final states and the backward's saved tensors
        if tr is not None:
            launch_carry.cp_fold_carry(o, finals, saved, tr, c, run.allow_tf32)
        if run.train:
            ctx.run, ctx.ms = run, ms
            ctx.save_for_backward(q, k, v, g, beta, init, A_log, dt_bias, m, *saved,
                                  *((tr.u, tr.m) if tr is not None else (None, None)))
        if not run.need_final:
            ctx.mark_non_differentiable(finals)
        return o, finals

    @staticmethod
    def backward(ctx, do, dfinal):
        run = ctx.run
        lp = run.lp
        q, k, v, g, beta, init, A_log, dt_bias, m, *rest = ctx.saved_tensors
        saved, (u, m_first) = kda_launch.Saved(*rest[:-2]), rest[-2:]
        if not run.need_final:
            dfinal = None
        do = do.contiguous()            # once for both readers (a loss's sum hands an expanded one)
        # 1. this rank's own gradient of its carry: through its outputs and its carried rows' final states
        dc = None
        if run.carried:
            dc = launch_carry.cp_carry_grad(u, do, run.carried, q.dtype, run.allow_tf32)
            if dfinal is not None:
                dc += m_first.transpose(-1, -2) @ dfinal[:run.carried].to(dc.dtype)
        # 2. the gradient of the state this rank hands on
        like = q.new_empty(run.carry_shape(q, v), dtype=torch.float32)
        dx = carry_grad(lp, KDA_MAP, m, ctx.ms, dc, like, run.scheme, run.group)
        # 3. one backward, dX joining the last row's final-state gradient
        if dx is not None:
            rows = lp.n_pieces if lp.varlen else run.batch
            dfinal = (dx.new_zeros((rows,) + tuple(dx.shape[1:])) if dfinal is None
                      else dfinal.to(torch.float32, copy=True))
            if lp.varlen:
                dfinal[-1:] += dx
            else:
                dfinal += dx
        # (the carried rows' initial state is a constant 0: their dinit, the carry's whole gradient, is dropped)
        need_dinit = ctx.needs_input_grad[5]
        dq, dk, dv, dg, db, dinit, dal, ddt = kda_launch.train_backward(
            q, k, v, g, beta, init if need_dinit else None, lp.cu_local, A_log, dt_bias, saved, do, dfinal,
            run.scale, run.lower_bound, run.use_qk_l2norm, run.allow_tf32, chunks=run.chunks)
        dinit = dinit.to(init.dtype) if dinit is not None else None
        dal = dal.to(A_log.dtype) if dal is not None else None
        ddt = ddt.to(dt_bias.dtype) if ddt is not None else None
        return dq, dk, dv, dg, db, dinit, dal, ddt, None


def kda(a: KDAArgs, init: Optional[torch.Tensor], lp: LinearPlan, scheme: str, group, need_final: bool):
    """(o_local, the local final state of every row / piece) of the validated call ``a`` on this rank's shards,
    its rows from ``init`` (``linear.initial_rows`` without the carry), on the plan ``lp``."""
    tensors = (a.q, a.k, a.v, a.g, a.beta, init, a.A_log, a.dt_bias)
    train = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return _KDATritonCP.apply(*tensors, _Run(a, lp, scheme, group, need_final, train))
