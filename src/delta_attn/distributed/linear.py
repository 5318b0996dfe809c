"""Context-parallel KDA by state passing, and what both linear operators share (the call set-up, the
final states).

The state after a shard is affine in the state before it: ``S_out = M S_in + B`` (M is K x K per value
head, applied to the K rows of the K x V state). On the Triton backend KDA runs ``kda_triton.py`` (the
chunk-local work once, at V value columns, the transition from a second scan of the carried rows, the carry
folded in by kernels, one backward). Every other backend runs the widened local pass here, a seam of two
functions:

1. :meth:`_KDA.local_pass`: the shard's tokens from state 0 for the piece that continues a sequence from
   the previous rank, with the values augmented by an identity block (K extra value columns with zero
   values and identity initial state): one launch returns ``o_local`` (zero start), the zero-start final
   states B, the transition M (the extra columns of the final state) and ``u_t`` (the extra output
   columns) with ``o_t = o_t(S_in = 0) + u_t S_in``;
2. the exchange (``_carry.py``): every rank's carry ``S_in``, from the plan's chain of (M, B) summaries;
3. :meth:`_KDA.apply_carry`: ``o += u S_in`` on the tokens that continue a sequence from the previous rank,
   and the final state of that piece ``B += M S_in``; the final states of the sequences that end on this
   rank are gathered so every rank returns all of them (:func:`distribute_finals`).

Only the first piece of a shard (the sequence that crosses in from the previous rank) needs the identity
block; sequences that start inside a shard start from their own ``initial_state`` row. Gradients come from
autograd through the operator and the exchange's own backward. The gated diagonal operator runs
exchange-first instead (``diag.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _checks as C
from ..ops.kda import api as kda_api
from ..reference import accumulation_dtype
from . import _comm
from ._carry import KDA_MAP, STATE_PASSING, CarryExchange
from ._comm import group_rank_world
from .plan import LinearPlan, Plan, prepare, resolve, value_checks


# ------------------------------------------------------------------------------------------------
# shared by both linear operators: the call's plan, the initial-state rows, the final states
# ------------------------------------------------------------------------------------------------

def setup(op: str, q, cu_seqlens, group, state_passing, plan: Optional[Plan]) -> LinearPlan:
    """Checks of the call that read no device value, then its plan (built here when none is given)."""
    C.one_of("state_passing", state_passing, STATE_PASSING)
    rank, world = group_rank_world(group)
    t_local = q.shape[1]
    C.positive_dim("the local sequence length (q.shape[1])", t_local)
    varlen = cu_seqlens is not None or (isinstance(plan, Plan) and plan.varlen)
    if varlen and q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {q.shape[0]}")

    def build():
        if cu_seqlens is not None:
            C.cu_seqlens_meta("cu_seqlens", cu_seqlens, q.device)
        return prepare(seqlen=world * t_local, cu_seqlens=cu_seqlens, group=group, device=q.device)

    return resolve(plan, op, group, build, device=q.device, varlen=varlen, t_local=t_local,
                   cu_seqlens=cu_seqlens).linear()


def num_states(lp: LinearPlan, q) -> int:
    """Rows of ``initial_state`` / ``final_state``: sequences of the packed batch, or the batch."""
    return lp.n_seq if lp.varlen else q.shape[0]


def initial_rows(lp: LinearPlan, initial_state, carry=None):
    """The local call's initial state per row (pieces, varlen; the batch, dense): a sequence that starts on
    this rank starts from its ``initial_state`` row, the first piece of one that continues from ``carry`` (0
    when None). None when every row starts from 0."""
    if not lp.varlen:
        if lp.cont[lp.rank]:
            return carry
        return initial_state
    rows = None if initial_state is None else initial_state.index_select(0, lp.seq)
    if not lp.cont[lp.rank]:
        return rows
    if carry is None:
        carry = (rows.new_zeros((1,) + rows.shape[1:]) if rows is not None else None)
        if carry is None:
            return None
    if lp.n_pieces == 1:
        return carry
    rest = rows[1:] if rows is not None else carry.new_zeros((lp.n_pieces - 1,) + carry.shape[1:])
    return torch.cat([carry.to(rest.dtype), rest])


def distribute_finals(lp: LinearPlan, finals, initial_state, group):
    """Every sequence's final state on every rank from each rank's local finals (one per row): dense, the
    last rank's, broadcast; varlen, the states of the sequences that end on each rank, all-gathered
    (empty sequences keep their initial state). Differentiable (``_comm``)."""
    if not lp.varlen:
        return _comm.broadcast(finals, lp.world - 1, group)
    own = finals.index_select(0, lp.owned)
    pad = finals.new_zeros((lp.max_owned - lp.n_owned,) + finals.shape[1:])
    stacked = _comm.tie(torch.cat([own, pad]) if pad.shape[0] else own, finals)
    gathered = _comm.all_gather(stacked, group).flatten(0, 1)          # (W * max_owned, ...)
    empty = (initial_state.to(finals.dtype) if initial_state is not None
             else finals.new_zeros((lp.n_seq,) + finals.shape[1:]))
    return torch.cat([gathered, empty]).index_select(0, lp.final_index)


# ------------------------------------------------------------------------------------------------
# KDA: the local pass with the identity block, and the carry applied
# ------------------------------------------------------------------------------------------------

@dataclass
class LocalPass:
    """What KDA's local pass gives the exchange and the correction (the seam a fused kernel fills):
    ``o`` (B, T_local, HV, V) with the carried rows started from 0; ``finals`` (rows, HV, K, V) the final
    state of every row (zero start for the carried rows: B); and for the ``n_id`` carried rows (the first
    ``first_len`` tokens of rows [0, n_id)): ``u`` (n_id, first_len, HV, K) with ``o_t += u_t S_in`` and
    ``m`` (n_id, HV, K, K), the transition with ``S_out = M S_in + B``. ``u``, ``m`` None when no row is
    carried."""
    o: torch.Tensor
    finals: torch.Tensor
    u: Optional[torch.Tensor] = None
    m: Optional[torch.Tensor] = None


class _KDA:
    def __init__(self, q, k, v, g, beta, kwargs, backend):
        self.q, self.k, self.v, self.g, self.beta = q, k, v, g, beta
        self.kw, self.backend = kwargs, backend
        self.kdim = q.shape[-1]

    def state_shape(self):
        return (self.v.shape[2], self.kdim, self.v.shape[3])

    def _call(self, tensors, init, cu, backend):
        q, k, v, g, beta = tensors
        with C.values_checked():                # cu: the plan's, from checked global offsets
            return kda_api.kda(q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cu,
                               backend=backend, **self.kw)

    def local_pass(self, init, lp: LinearPlan) -> LocalPass:
        """Seam 1: the shard from ``init`` (:func:`initial_rows` without the carry), the carried rows
        (cont: the first piece, varlen; every row, dense) from 0, with their transition and response."""
        t, cu = (self.q, self.k, self.v, self.g, self.beta), lp.cu_local
        if not lp.cont[lp.rank]:
            return LocalPass(*self._call(t, init, cu, self.backend))
        n, (hv, kd, vd) = (lp.n_pieces if lp.varlen else self.q.shape[0]), self.state_shape()
        n_id, first_len = (1 if lp.varlen else n), lp.first_len
        sdt = init.dtype if init is not None else accumulation_dtype(self.q.dtype)
        init0 = init if init is not None else self.q.new_zeros((n, hv, kd, vd), dtype=sdt)
        eye = torch.zeros(n, hv, kd, kd, dtype=sdt, device=self.q.device)
        eye[:n_id] = torch.eye(kd, dtype=sdt, device=eye.device)
        backend = self.backend
        v_aug = torch.cat([self.v, self.v.new_zeros(self.v.shape[:3] + (kd,))], -1)
        t_aug, init_aug = t[:2] + (v_aug,) + t[3:], torch.cat([init0, eye], -1)
        if self.fuse_ok(t_aug, init_aug, cu, backend):
            # one launch: value columns [V, V + K) carry the identity
            o, f = self._call(t_aug, init_aug, cu, backend)
            return LocalPass(o[..., :vd], f[..., :vd], o[:n_id, :first_len, :, vd:], f[:n_id, ..., vd:])
        # the backend refuses V + K columns: a second launch over the first piece's tokens only
        o, f = self._call(t, init, cu, backend)
        first = tuple(x[:n_id, :first_len] for x in t[:2]) + (v_aug[:n_id, :first_len, :, vd:],) + tuple(
            x[:n_id, :first_len] for x in t[3:])
        u, m = self._call(first, eye[:n_id], None, backend)
        return LocalPass(o, f, u, m)

    @staticmethod
    def apply_carry(local: LocalPass, carry, lp: LinearPlan):
        """Seam 2: the true carry applied: ``o += u S_in`` on the carried rows' first piece (in float32 or
        float64) and their final states ``B += M S_in``. Returns (o, finals)."""
        if local.u is None:
            return local.o, local.finals
        o, n_id, first_len = local.o, local.u.shape[0], lp.first_len
        cdt = carry.dtype
        fixed = (o[:n_id, :first_len].to(cdt) + torch.einsum("bthk,bhkv->bthv", local.u.to(cdt), carry)).to(o.dtype)
        o = torch.cat([fixed, o[:, first_len:]], 1) if lp.varlen else fixed
        f = local.finals
        fixed_f = f[:n_id] + KDA_MAP.apply(local.m, carry).to(f.dtype)
        return o, (torch.cat([fixed_f, f[n_id:]]) if f.shape[0] > n_id else fixed_f)

    def fuse_ok(self, t_aug, init_aug, cu, backend) -> bool:
        """Whether ``backend`` takes the V + K value columns (its head-dim limits)."""
        with C.values_checked():
            return kda_api.kda.plan(*t_aug, initial_state=init_aug, output_final_state=True, cu_seqlens=cu,
                                    backend=backend, **self.kw).chosen is not None

    def resolve(self, init, cu):
        """The backend the plain local call runs on (the dispatcher's choice for ``"auto"``), so the augmented
        call never lands elsewhere."""
        if self.backend != "auto":
            return self.backend
        with C.values_checked():
            return kda_api.kda.plan(self.q, self.k, self.v, self.g, self.beta, initial_state=init,
                                    output_final_state=True, cu_seqlens=cu, backend="auto",
                                    **self.kw).chosen or "auto"   # none: the call raises why


def kda(q, k, v, g, beta, *, group=None, state_passing: str = "allgather", scale=None, initial_state=None,
        output_final_state=False, cu_seqlens=None, use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None,
        allow_tf32=False, backend="auto", plan: Optional[Plan] = None, **unknown):
    """Context-parallel :func:`delta_attn.kda`: q, k, v, g, beta are this rank's shards of dim 1.

    Ranks of ``group`` (default: the world) hold consecutive, equal shards in rank order. Keywords are
    those of ``delta_attn.kda``, and so is the domain of g (without ``A_log`` a log decay <= 0: a positive
    entry of this rank's shard is a ``ValueError`` naming g, where value checks run: not in a call given a plan,
    which reads nothing on the host). ``initial_state``
    (N, HV, K, V) is the state before the whole
    sequence (the same on every rank); ``cu_seqlens`` describes the whole packed batch (global offsets,
    ending at W * T_local) and a sequence may span ranks. Returns ``(o_local, final_state)`` with the
    final state of every sequence on every rank. ``state_passing``: "allgather" (default) or "ring".
    ``plan``: the batch's :func:`delta_attn.distributed.prepare` (then ``cu_seqlens`` may be left out, and
    the distributed layer reads nothing on the host; without it one is built from ``cu_seqlens``).
    Gradients: complete for the shards; ``initial_state``, ``A_log``, ``dt_bias`` get this rank's share
    (sum over the group = the single-process gradient; FSDP / DDP over a mesh that includes this group
    do that sum for parameters).
    """
    C.unknown_keywords("kda", unknown, kda_api.FLA_KEYWORDS)
    with value_checks(plan):
        args = kda_api.validate(q, k, v, g, beta, scale, None, output_final_state, None, use_qk_l2norm, A_log,
                                dt_bias, lower_bound, allow_tf32)
    lp = setup("dd.kda", q, cu_seqlens, group, state_passing, plan)
    C.state("initial_state", initial_state, (num_states(lp, q),) + (v.shape[2], q.shape[3], v.shape[3]), q.device,
            "(N, HV, K, V) float32")
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
              allow_tf32=allow_tf32)
    op = _KDA(q, k, v, g, beta, kw, backend)
    init = initial_rows(lp, initial_state)
    op.backend = op.resolve(init, lp.cu_local)
    if op.backend == "triton":
        # the Triton kernels: the chunk-local work once, at V columns (kda_triton.py)
        from . import kda_triton
        o, finals = kda_triton.kda(args, init, lp, state_passing, group, output_final_state)
    else:
        local = op.local_pass(init, lp)
        # the summary handed on: the last row's final state, and its transition when the carry passes through
        last = local.finals if not lp.varlen else local.finals[-1:]
        m = local.m if lp.passes[lp.rank] else last.new_zeros(last.shape[:-1] + (op.kdim,))
        carry = CarryExchange.apply(m, last, lp, KDA_MAP, state_passing, group)
        o, finals = _KDA.apply_carry(local, carry, lp)
        # every rank's outputs depend on every collective (so every rank runs their backward, in one order)
        o = _comm.tie(o, carry)
    if not output_final_state:
        return o, None
    final = distribute_finals(lp, finals, initial_state, group)
    return _comm.tie(o, final), final
