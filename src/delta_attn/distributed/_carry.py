"""The carry of state passing, forward and backward, shared by the linear operators.

The state after rank j's shard is affine in the state before it: ``c_{j+1} = M_j c_j + B_j`` where rank j's
shard is one piece of a sequence that continues on both sides (``passes[j]`` in the plan), else
``c_{j+1} = B_j`` (the sequence crossing into rank j + 1 started on rank j: a reset, a select and never a
multiply by 0, so a NaN of an earlier sequence cannot leak). Backward, the gradient of a rank's carry from
its own work, ``dc_j``, reaches the ranks before it through the transposed maps:
``dX_r = d c_{r+1} = dc_{r+1} + M_{r+1}^T (dc_{r+2} + ...)`` along the chain of ranks that pass it.

``M_j`` and ``B_j`` enter the rest of the computation only through ``M_j c_j + B_j``, so their gradients
are ``dB_j = dX_j`` and ``dM_j = dX_j c_j^T`` (KDA) / ``dX_j * c_j`` (diagonal).

Two schedules (``state_passing``), both outside autograd and both with the plan's tables, so ranks that
need nothing exchange nothing:
- ``"allgather"``: one all-gather of every rank's (M, B) (backward: of every rank's ``dc``), then each
  rank combines its chain locally (FLA's KCP scheme);
- ``"ring"``: the carry travels rank to rank (W - 1 hops at most; backward, the same hops in reverse).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _comm
from .plan import LinearPlan

STATE_PASSING = ("allgather", "ring")


class Affine:
    """How a summary M acts on a state: KDA's K x K matrix on the K rows of a K x V state, or the
    diagonal operator's element-wise decay."""

    def __init__(self, matrix: bool):
        self.matrix = matrix

    def apply(self, m, c):
        return m @ c if self.matrix else m * c

    def apply_t(self, m, d):
        """The gradient of ``apply(m, c)`` with respect to c for output gradient d."""
        return m.transpose(-1, -2) @ d if self.matrix else m * d

    def grad_m(self, d, c):
        """The gradient of ``apply(m, c)`` with respect to m for output gradient d."""
        return d @ c.transpose(-1, -2) if self.matrix else d * c


KDA_MAP = Affine(matrix=True)


def _pack(*xs):
    return torch.cat([x.reshape(-1) for x in xs])


def _unpack(flat, *likes):
    out, o = [], 0
    for x in likes:
        out.append(flat[o:o + x.numel()].view(x.shape))
        o += x.numel()
    return out


def carry(lp: LinearPlan, aff: Affine, m: torch.Tensor, b: torch.Tensor, scheme: str, group):
    """Forward exchange. ``m``, ``b``: this rank's summary (zeros where it hands nothing on). Returns
    ``(carry into this rank or None, the gathered M of every rank (allgather) or None)``."""
    r = lp.rank
    if not lp.any_carry:
        return None, None
    if scheme == "allgather":
        gathered = _comm.gather(_pack(m, b), group, lp.world)
        ms, bs = zip(*(_unpack(row, m, b) for row in gathered.unbind(0)))
        c = None
        if lp.cont[r]:
            for j in lp.carry_chain(r):
                c = bs[j] if c is None else aff.apply(ms[j], c) + bs[j]
        return c, ms
    c = b.new_empty(b.shape) if lp.cont[r] else None
    src = r - 1 if lp.cont[r] else None
    if lp.passes[r]:
        _comm.send_recv(None, None, c, src, group)
        _comm.send_recv(aff.apply(m, c) + b, r + 1, None, None, group)
    else:
        _comm.send_recv(b if lp.hands_on[r] else None, r + 1 if lp.hands_on[r] else None, c, src, group)
    return c, None


def carry_grad(lp: LinearPlan, aff: Affine, m: torch.Tensor, ms, dc: Optional[torch.Tensor], like: torch.Tensor,
               scheme: str, group) -> Optional[torch.Tensor]:
    """Backward exchange: ``dc`` the gradient of this rank's carry from its own work (None: zeros), ``m`` its
    summary, ``ms`` every rank's (allgather). Returns dX, the gradient of the carry this rank hands on (the
    state after its last piece), or None when it hands none on."""
    r = lp.rank
    if not lp.any_carry:
        return None
    dc = like.new_zeros(like.shape) if dc is None else dc
    if scheme == "allgather":
        dcs = _comm.gather(dc, group, lp.world).unbind(0)
        if not lp.hands_on[r]:
            return None
        d = None
        for j in reversed(lp.grad_chain(r)):
            d = dcs[j] if d is None else dcs[j] + aff.apply_t(ms[j], d)
        return d
    dx = like.new_empty(like.shape) if lp.hands_on[r] else None
    src = r + 1 if lp.hands_on[r] else None
    if lp.passes[r]:
        _comm.send_recv(None, None, dx, src, group)
        _comm.send_recv(dc + aff.apply_t(m, dx), r - 1, None, None, group)
    else:
        _comm.send_recv(dc if lp.cont[r] else None, r - 1 if lp.cont[r] else None, dx, src, group)
    return dx


class CarryExchange(torch.autograd.Function):
    """The exchange as an autograd node (KDA, whose local pass is differentiated by autograd): forward
    (M, B) -> the carry into this rank (zeros where none); backward dc -> (dM, dB) by :func:`carry_grad`."""

    @staticmethod
    def forward(ctx, m, b, lp, aff, scheme, group):
        c, ms = carry(lp, aff, m, b, scheme, group)
        ctx.lp, ctx.aff, ctx.scheme, ctx.group, ctx.ms = lp, aff, scheme, group, ms
        ctx.save_for_backward(m, c if c is not None else None)
        ctx.b_shape = b.shape
        return c if c is not None else torch.zeros_like(b)

    @staticmethod
    def backward(ctx, dc):
        m, c = ctx.saved_tensors
        lp, aff = ctx.lp, ctx.aff
        dx = carry_grad(lp, aff, m, ctx.ms, dc if lp.cont[lp.rank] else None, dc, ctx.scheme, ctx.group)
        dm = torch.zeros_like(m)
        db = torch.zeros_like(dc)
        if dx is not None:
            db = dx
            if lp.passes[lp.rank]:
                dm = aff.grad_m(dx, c)
        return dm, db, None, None, None, None
