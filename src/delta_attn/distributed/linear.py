"""Context-parallel linear attention (KDA, gated diagonal) by state passing.

Each rank runs the single-GPU operator on its shard. The state after a shard is affine in the state
before it: ``S_out = M S_in + B`` (KDA: M is K x K per value head, applied to the K rows of the
K x V state; gated diagonal: M is the element-wise decay ``exp(sum g)``). The shipped kernels give M
as well as B in the same launch because the recurrence is linear in the state:

1. local pass: the shard's tokens with the values augmented by an identity block (KDA: K extra
   value columns with zero values and identity initial state; diagonal: a second copy of the heads
   with zero k, v and initial state one). The extra columns of the final state are M, the extra
   output columns are ``u_t`` with ``o_t = o_t(S_in = 0) + u_t S_in``;
2. exchange: every rank needs the carry ``S_in`` of its first token, a prefix combine of the
   (M, B) summaries of the ranks before it. ``state_passing="allgather"`` gathers all summaries (one
   collective of ``K (K + V)`` numbers per head and rank, FLA's KCP scheme) and combines locally;
   ``"ring"`` passes the carry rank to rank (W - 1 sequential hops of ``K V`` numbers);
3. correction: ``o += u S_in`` on the tokens that continue a sequence from the previous rank, and the
   final states of the sequences that end on this rank, gathered so every rank returns all of them.

Only the first piece of a shard (the sequence that crosses in from the previous rank) needs the
identity block; sequences that start inside a shard start from their own ``initial_state`` row.
Gradients come from autograd through the operators and the differentiable collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from .. import _checks as C
from ..ops.diag import api as diag_api
from ..ops.kda import api as kda_api
from ..reference import accumulation_dtype
from . import _comm
from ._comm import group_rank_world

STATE_PASSING = ("allgather", "ring")


# ------------------------------------------------------------------------------------------------
# which pieces of which sequences this rank holds (varlen)
# ------------------------------------------------------------------------------------------------

@dataclass
class _Pieces:
    """This rank's tokens [start, start + t_local) cut by the global ``cu_seqlens``."""
    local_cu: List[int]          # piece boundaries relative to the shard start
    seq: List[int]               # global sequence index of each piece
    cont: bool                   # the first piece continues a sequence begun on an earlier rank
    owned: List[int]             # pieces whose sequence ends on this rank (final state owned here)
    owners: List[tuple]          # per global sequence: (rank, slot among its owned) or None if empty
    max_owned: int               # the most sequences any rank owns (gather padding)


def _pieces(cu: List[int], t_local: int, rank: int, world: int) -> _Pieces:
    start, end = rank * t_local, (rank + 1) * t_local
    local_cu, seq, owned = [0], [], []
    owners, counts = [], [0] * world
    cont = False
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        if a == b:
            owners.append(None)
            continue
        r_end = (b - 1) // t_local                  # the rank holding the sequence's last token
        owners.append((r_end, counts[r_end]))
        counts[r_end] += 1
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            if not seq:
                cont = a < start
            if r_end == rank:
                owned.append(len(seq))
            seq.append(n)
            local_cu.append(hi - start)
    return _Pieces(local_cu, seq, cont, owned, owners, max(counts))


# ------------------------------------------------------------------------------------------------
# the two operators: local pass with the identity block, how M acts on a state, the output correction
# ------------------------------------------------------------------------------------------------

class _KDA:
    name = "kda"

    def __init__(self, q, k, v, g, beta, kwargs, backend):
        self.q, self.k, self.v, self.g, self.beta = q, k, v, g, beta
        self.kw, self.backend = kwargs, backend
        self.kdim = q.shape[-1]

    def state_shape(self):
        return (self.v.shape[2], self.kdim, self.v.shape[3])

    @staticmethod
    def apply(M, c):                        # M (N, HV, K, K) acting on the K rows of c (N, HV, K, V)
        return M @ c

    @staticmethod
    def correct(u, c):                      # u (N, L, HV, K), c (N, HV, K, V) -> (N, L, HV, V)
        return torch.einsum("bthk,bhkv->bthv", u, c)

    def _call(self, tensors, init, cu, backend):
        q, k, v, g, beta = tensors
        return kda_api.kda(q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cu,
                           backend=backend, **self.kw)

    def run(self, init, cu, id_rows, first_len):
        """Local pass. ``id_rows``: rows of the local batch / pieces whose carry is unknown (None: no
        carry needed). Returns o0, finals, and with id_rows u (N_id, first_len, ...) and M (N_id, ...)."""
        t = (self.q, self.k, self.v, self.g, self.beta)
        if id_rows is None:
            o, f = self._call(t, init, cu, self.backend)
            return o, f, None, None
        n, (hv, kd, vd) = len(id_rows), self.state_shape()
        sdt = init.dtype if init is not None else accumulation_dtype(self.q.dtype)
        init0 = init if init is not None else self.q.new_zeros((len(id_rows), hv, kd, vd), dtype=sdt)
        eye = torch.zeros(n, hv, kd, kd, dtype=sdt, device=self.q.device)
        eye[torch.tensor(id_rows, dtype=torch.bool, device=eye.device)] = torch.eye(kd, dtype=sdt, device=eye.device)
        n_id = sum(id_rows)
        backend = self._resolve(t, init, cu)
        v_aug = torch.cat([self.v, self.v.new_zeros(self.v.shape[:3] + (kd,))], -1)
        t_aug, init_aug = t[:2] + (v_aug,) + t[3:], torch.cat([init0, eye], -1)
        if self.fuse_ok(t_aug, init_aug, cu, backend):
            # one launch: value columns [V, V + K) carry the identity
            o, f = self._call(t_aug, init_aug, cu, backend)
            return (o[..., :vd], f[..., :vd], o[:n_id, :first_len, :, vd:], f[:n_id, ..., vd:])
        # the backend refuses V + K columns: a second launch over the first piece's tokens only
        o, f = self._call(t, init, cu, backend)
        first = tuple(x[:n_id, :first_len] for x in t[:2]) + (v_aug[:n_id, :first_len, :, vd:],) + tuple(
            x[:n_id, :first_len] for x in t[3:])
        u, m = self._call(first, eye[:n_id], None, backend)
        return o, f, u, m

    def fuse_ok(self, t_aug, init_aug, cu, backend) -> bool:
        """Whether ``backend`` takes the V + K value columns (the Triton kernels stop at 256)."""
        return kda_api.kda.plan(*t_aug, initial_state=init_aug, output_final_state=True, cu_seqlens=cu,
                                backend=backend, **self.kw).chosen is not None

    def _resolve(self, t, init, cu):
        """The backend the plain local call runs on (so the augmented call never lands elsewhere)."""
        if self.backend != "auto":
            return self.backend
        return kda_api.kda.plan(*t, initial_state=init, output_final_state=True, cu_seqlens=cu,
                                backend="auto", **self.kw).chosen or "auto"   # none: the call raises why


class _Diag:
    name = "gated_diag_attn"

    def __init__(self, q, k, v, g, kwargs, backend):
        self.q, self.k, self.v, self.g = q, k, v, g
        self.kw, self.backend = kwargs, backend

    def state_shape(self):
        return tuple(self.q.shape[2:])

    @staticmethod
    def apply(M, c):                        # element-wise decay
        return M * c

    @staticmethod
    def correct(u, c):                      # u (N, L, H, D), c (N, H, D)
        return u * c.unsqueeze(1)

    def run(self, init, cu, id_rows, first_len):
        q, k, v, g = self.q, self.k, self.v, self.g
        if id_rows is None:
            return diag_api.gated_diag_attn(q, k, v, g, initial_state=init, output_final_state=True,
                                            cu_seqlens=cu, backend=self.backend, **self.kw) + (None, None)
        n, (h, d) = len(id_rows), self.state_shape()
        sdt = init.dtype if init is not None else accumulation_dtype(q.dtype)
        init0 = init if init is not None else q.new_zeros((n, h, d), dtype=sdt)
        ones = torch.tensor(id_rows, dtype=sdt, device=q.device).view(n, 1, 1).expand(n, h, d)
        # one launch: heads [H, 2H) run zero k, v from state one, so they hold the decay products
        zeros = k.new_zeros(k.shape)
        o, f = diag_api.gated_diag_attn(torch.cat([q, q], 2), torch.cat([k, zeros], 2), torch.cat([v, zeros], 2),
                                        torch.cat([g, g], 2), initial_state=torch.cat([init0, ones], 1),
                                        output_final_state=True, cu_seqlens=cu, backend=self.backend, **self.kw)
        n_id = sum(id_rows)
        return o[:, :, :h], f[:, :h], o[:n_id, :first_len, h:], f[:n_id, h:]


# ------------------------------------------------------------------------------------------------
# the carry: all-gather of (M, B) summaries, or a ring
# ------------------------------------------------------------------------------------------------

def _prefix(apply, Ms, Bs, upto):
    """Carry into rank ``upto``: c_0 = 0, c_{r+1} = M_r c_r + B_r."""
    c = torch.zeros_like(Bs[0])
    for r in range(upto):
        c = apply(Ms[r], c) + Bs[r]
    return c


class _RingCarry(torch.autograd.Function):
    """Forward: receive c_r from rank r - 1, send c_{r+1} = M_r c_r + B_r to rank r + 1, return c_r.
    Backward: the reverse ring of dL/dc (rank r sends dL/dc_r = its own use + M_r^T dL/dc_{r+1})."""

    @staticmethod
    def forward(ctx, M, B, apply, group, rank, world):
        c = torch.zeros_like(B)
        if rank > 0:
            _comm.send_recv(None, None, c, rank - 1, group)
        if rank < world - 1:
            _comm.send_recv(apply(M, c) + B, rank + 1, None, None, group)
        ctx.save_for_backward(M, B, c)
        ctx.apply_, ctx.group, ctx.rank, ctx.world = apply, group, rank, world
        return c

    @staticmethod
    def backward(ctx, grad_c):
        M, B, c = ctx.saved_tensors
        rank, world, group = ctx.rank, ctx.world, ctx.group
        dM, dB = torch.zeros_like(M), torch.zeros_like(B)
        if rank < world - 1:
            g_next = torch.empty_like(c)
            _comm.send_recv(None, None, g_next, rank + 1, group)
            with torch.enable_grad():
                Mx, cx, Bx = (x.detach().requires_grad_() for x in (M, c, B))
                dM, dc, dB = torch.autograd.grad(ctx.apply_(Mx, cx) + Bx, (Mx, cx, Bx), g_next)
            grad_c = grad_c + dc
        if rank > 0:
            _comm.send_recv(grad_c, rank - 1, None, None, group)
        return dM, dB, None, None, None, None


# ------------------------------------------------------------------------------------------------
# the driver shared by both operators
# ------------------------------------------------------------------------------------------------

def _run(op, initial_state, cu_list, t_local, group, rank, world, state_passing, output_final_state):
    varlen = cu_list is not None
    device = op.q.device
    if varlen:
        p = _pieces(cu_list, t_local, rank, world)
        cont = p.cont
        first_len = p.local_cu[1]
        rows = len(p.seq)
        init = None
        if initial_state is not None:
            init = initial_state[torch.tensor(p.seq, device=device)]
            if cont:
                init = torch.cat([torch.zeros_like(init[:1]), init[1:]])
        elif cont:
            init = None
        cu_local = torch.tensor(p.local_cu, dtype=torch.int32, device=device)
        id_rows = [i == 0 and cont for i in range(rows)] if cont else None
    else:
        cont, first_len, rows = rank > 0, t_local, op.q.shape[0]
        init = initial_state if rank == 0 else None
        cu_local, id_rows = None, ([True] * rows if cont else None)

    o0, finals, u, M_first = op.run(init, cu_local, id_rows, first_len)

    # summary handed on: the last piece's final state, and its dependence on this rank's carry
    if varlen:
        B_last = finals[-1:]
        M_last = M_first if (cont and rows == 1) else None
    else:
        B_last, M_last = finals, M_first
    if M_last is None:
        m_shape = (B_last.shape[0],) + ((op.state_shape()[0], op.kdim, op.kdim) if op.name == "kda"
                                        else op.state_shape())
        M_last = B_last.new_zeros(m_shape)

    if state_passing == "allgather":
        n_m = M_last[0].numel()
        packed = torch.cat([M_last.flatten(1), B_last.flatten(1)], 1)
        gathered = _comm.all_gather(packed, group)                       # (W, N_carry, M + B numbers)
        Ms = [x[:, :n_m].view(M_last.shape) for x in gathered.unbind(0)]
        Bs = [x[:, n_m:].view(B_last.shape) for x in gathered.unbind(0)]
        carry = _comm.tie(_prefix(op.apply, Ms, Bs, rank), gathered)
    else:
        carry = _RingCarry.apply(M_last, B_last, op.apply, group, rank, world)

    # outputs of the tokens that continue a sequence: o += u c
    o = o0
    if cont:
        cdt = carry.dtype
        fixed = (o[:u.shape[0], :first_len].to(cdt) + op.correct(u.to(cdt), carry)).to(o.dtype)
        o = torch.cat([fixed, o[:, first_len:]], 1) if varlen else fixed
    # every rank's outputs depend on every collective (so every rank runs their backward, in one order)
    if not output_final_state:
        return _comm.tie(o, carry), None

    if not varlen:
        if state_passing == "allgather":
            final = _prefix(op.apply, Ms, Bs, world)
        else:
            final = _comm.broadcast(op.apply(M_last, carry) + B_last, world - 1, group)
        return _comm.tie(o, final), final

    # varlen: each rank's owned final states (first piece corrected), gathered to every rank
    own = [finals[i] + (op.apply(M_first[0], carry[0]) if (i == 0 and cont) else 0) for i in p.owned]
    pad = [torch.zeros_like(finals[0])] * (p.max_owned - len(own))
    stacked = torch.stack(own + pad) if own or pad else finals.new_zeros((0,) + finals.shape[1:])
    gathered = _comm.all_gather(_comm.tie(stacked, carry), group).flatten(0, 1)   # (W * max_owned, ...)
    n_seq = len(cu_list) - 1
    empty = (initial_state.to(finals.dtype) if initial_state is not None
             else finals.new_zeros((n_seq,) + finals.shape[1:]))
    index = [rs[0] * p.max_owned + rs[1] if rs is not None else gathered.shape[0] + n
             for n, rs in enumerate(p.owners)]
    final = torch.cat([gathered, empty]).index_select(0, torch.tensor(index, device=device))
    return _comm.tie(o, final), final


def _setup(q, cu_seqlens, group, state_passing):
    rank, world = group_rank_world(group)
    C.one_of("state_passing", state_passing, STATE_PASSING)
    t_local = q.shape[1]
    C.positive_dim("the local sequence length (q.shape[1])", t_local)
    cu_list, n = None, q.shape[0]
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {q.shape[0]}")
        n = C.cu_seqlens_meta("cu_seqlens", cu_seqlens, q.device)
        cu_list = cu_seqlens.tolist()
        C.cu_seqlens_values("cu_seqlens", cu_list, world * t_local)
    return rank, world, t_local, cu_list, n


def kda(q, k, v, g, beta, *, group=None, state_passing: str = "allgather", scale=None, initial_state=None,
        output_final_state=False, cu_seqlens=None, use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None,
        allow_tf32=False, backend="auto", **unknown):
    """Context-parallel :func:`delta_attn.kda`: q, k, v, g, beta are this rank's shards of dim 1.

    Ranks of ``group`` (default: the world) hold consecutive, equal shards in rank order. Keywords are
    those of ``delta_attn.kda``, and so is the domain of g (without ``A_log`` a log decay <= 0: a positive
    entry of this rank's shard is a ``ValueError`` naming g, where value checks run). ``initial_state``
    (N, HV, K, V) is the state before the whole
    sequence (the same on every rank); ``cu_seqlens`` describes the whole packed batch (global offsets,
    ending at W * T_local) and a sequence may span ranks. Returns ``(o_local, final_state)`` with the
    final state of every sequence on every rank. ``state_passing``: "allgather" (default) or "ring".
    Gradients: complete for the shards; ``initial_state``, ``A_log``, ``dt_bias`` get this rank's share
    (sum over the group = the single-process gradient; FSDP / DDP over a mesh that includes this group
    do that sum for parameters).
    """
    C.unknown_keywords("kda", unknown, kda_api.FLA_KEYWORDS)
    kda_api.validate(q, k, v, g, beta, scale, None, output_final_state, None, use_qk_l2norm, A_log, dt_bias,
                     lower_bound, allow_tf32)
    rank, world, t_local, cu_list, n = _setup(q, cu_seqlens, group, state_passing)
    C.state("initial_state", initial_state, (n,) + (v.shape[2], q.shape[3], v.shape[3]), q.device,
            "(N, HV, K, V) float32")
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
              allow_tf32=allow_tf32)
    op = _KDA(q, k, v, g, beta, kw, backend)
    return _run(op, initial_state, cu_list, t_local, group, rank, world, state_passing, output_final_state)


def gated_diag_attn(q, k, v, g, *, group=None, state_passing: str = "allgather", initial_state=None,
                    output_final_state=False, cu_seqlens=None, backend="auto"):
    """Context-parallel :func:`delta_attn.gated_diag_attn` on this rank's shards of dim 1 (see :func:`kda`
    for the layout, ``cu_seqlens``, ``initial_state``, gradients and ``state_passing``). g is a log decay <= 0,
    as in :func:`delta_attn.gated_diag_attn`."""
    diag_api.validate(q, k, v, g, None, output_final_state, None)
    rank, world, t_local, cu_list, n = _setup(q, cu_seqlens, group, state_passing)
    C.state("initial_state", initial_state, (n,) + tuple(q.shape[2:]), q.device, "(N, H, D) float32")
    op = _Diag(q, k, v, g, {}, backend)
    return _run(op, initial_state, cu_list, t_local, group, rank, world, state_passing, output_final_state)
