"""Differentiable collectives on torch.distributed (NCCL on GPUs, gloo on CPU) used by context parallelism.

Gradient convention (the one of ``torch.distributed.nn``): every rank's use of a gathered tensor is a
separate use, so the gradient of a rank's contribution is the sum of the gradients that all ranks send
back. A tensor held identically on every rank (``initial_state``, ``A_log``) gets on each rank the part
of the gradient that flows from that rank's work; their sum over the group is the whole gradient.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist


def group_rank_world(group=None) -> Tuple[int, int]:
    """``(rank within group, group size)``; a clear error when torch.distributed is not set up."""
    if not dist.is_available():
        raise RuntimeError("delta_attn.distributed needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        raise RuntimeError("delta_attn.distributed needs an initialised process group: call "
                           "torch.distributed.init_process_group (NCCL on GPUs, gloo on CPU) first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None (the world group), "
                        f"got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group must contain the calling rank, got a group this rank is not a member of")
    return rank, dist.get_world_size(group)


def _reduce_own_slice(stacked: torch.Tensor, rank: int, group) -> torch.Tensor:
    """Sum over ranks of ``stacked`` (W, ...), keep this rank's slice: a reduce-scatter."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        out = torch.empty_like(stacked[0])
        dist.reduce_scatter_tensor(out, stacked.contiguous(), group=group)
        return out
    total = stacked.contiguous().clone()        # gloo has no reduce-scatter: all-reduce, keep own slice
    dist.all_reduce(total, group=group)
    return total[rank]


def gather(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """All-gather outside autograd: ``(W, *x.shape)``, row r is rank r's ``x``."""
    out = torch.empty((world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)
    return out


class _AllGather(torch.autograd.Function):
    """x (...) on every rank -> (W, ...) stacked in rank order; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x, group, rank, world):
        ctx.group, ctx.rank = group, rank
        return gather(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_own_slice(grad, ctx.rank, ctx.group), None, None, None


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """Differentiable all-gather: ``(W, *x.shape)``, row r is rank r's ``x``."""
    rank, world = group_rank_world(group)
    if world == 1:
        return x.unsqueeze(0)
    return _AllGather.apply(x, group, rank, world)


class _Broadcast(torch.autograd.Function):
    """Rank ``src``'s x on every rank; backward: the sum of all ranks' gradients lands on ``src``."""

    @staticmethod
    def forward(ctx, x, src, group, rank):
        ctx.src, ctx.group, ctx.rank = src, group, rank
        out = x.detach().clone().contiguous()
        dist.broadcast(out, dist.get_global_rank(group, src) if group is not None else src, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return (g if ctx.rank == ctx.src else torch.zeros_like(g)), None, None, None


def broadcast(x: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Differentiable broadcast from group rank ``src`` (every rank passes a tensor of the same shape)."""
    rank, world = group_rank_world(group)
    if world == 1:
        return x
    return _Broadcast.apply(x, src, group, rank)


def global_rank(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def send_recv(send: Optional[torch.Tensor], dst: Optional[int], recv: Optional[torch.Tensor],
              src: Optional[int], group=None) -> None:
    """Post one send and one receive (group ranks; either may be None) together and wait for both."""
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), global_rank(group, dst), group))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, global_rank(group, src), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class _Tie(torch.autograd.Function):
    """``x`` unchanged, with ``deps`` made its (zero-gradient) inputs."""

    @staticmethod
    def forward(ctx, x, *deps):
        ctx.deps = [(d.shape, d.dtype, d.device) for d in deps]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(torch.zeros(s, dtype=dt, device=dev) for s, dt, dev in ctx.deps)


def tie(x: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:
    """Make ``x`` depend on ``deps`` in the autograd graph. Every rank must run the backward of every
    collective, in the same order: chaining each collective's input to the previous one's output and the
    returned tensors to the last gives every rank one backward path through all of them, in reverse."""
    if not torch.is_grad_enabled() or not any(d.requires_grad for d in deps):
        return x
    return _Tie.apply(x, *deps)
