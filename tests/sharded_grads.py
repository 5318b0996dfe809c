"""Outputs and gradients of a linear operator (KDA, gated diagonal) in one process and sharded over the ranks of a
context-parallel call, for one loss (<o, w_o> + <final state, w_f>): what the context-parallel tests compare
(tests/distributed/test_distributed_linear.py, test_distributed_diag.py, tests/gpu/test_distributed_linear_gpu.py).
Inputs in :data:`REPLICATED` are given whole to every rank; their gradients are summed over the ranks.
"""
import torch

REPLICATED = ("initial_state", "A_log", "dt_bias")


def single_process(fn, xs, kw, weights, **extra):
    """(o, final, grads of xs + replicated kw) of one process; loss = <o, w_o> + <final, w_f>."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    kw = {n: (t.detach().clone().requires_grad_() if n in REPLICATED else t) for n, t in kw.items()}
    o, f = fn(*xs, **kw, **extra)
    loss = (o * weights[0].to(o.dtype)).sum() + ((f * weights[1].to(f.dtype)).sum() if f is not None else 0)
    leaves = xs + [kw[n] for n in REPLICATED if n in kw]
    return o.detach(), None if f is None else f.detach(), torch.autograd.grad(loss, leaves)


def sharded(fn, xs, kw, weights, world, **extra):
    """(o, final, grads) of the context-parallel call on this rank's shard of ``xs``; the replicated inputs'
    gradients summed over the ranks."""
    import torch.distributed as dist
    import delta_attn.distributed as dd
    xs = [dd.shard(x).detach().clone().requires_grad_() for x in xs]
    kw = {n: (t.detach().clone().requires_grad_() if n in REPLICATED else t) for n, t in kw.items()}
    o, f = fn(*xs, **kw, **extra)
    # every rank weights its own outputs and 1/W of the (replicated) final state
    loss = (o * dd.shard(weights[0]).to(o.dtype)).sum()
    if f is not None:
        loss = loss + (f * weights[1].to(f.dtype)).sum() / world
    leaves = xs + [kw[n] for n in REPLICATED if n in kw]
    grads = [torch.zeros_like(t) if gr is None else gr           # initial_state is unused past rank 0
             for t, gr in zip(leaves, torch.autograd.grad(loss, leaves, allow_unused=True))]
    for i in range(len(xs), len(grads)):                  # replicated inputs: each rank holds its share
        grads[i] = grads[i].contiguous()
        dist.all_reduce(grads[i])
    return o.detach(), None if f is None else f.detach(), grads


def loss_weights(seed, o_shape, f_shape):
    """The loss's weights of the output and (``f_shape`` given) of the final state, seeded."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return (torch.randn(o_shape, generator=gen, dtype=torch.float64),
            torch.randn(f_shape, generator=gen, dtype=torch.float64) if f_shape else None)


def grad_names(kw, n_x):
    """Names of the gradients ``single_process`` and ``sharded`` return: d0.. of the inputs, then d_<name>."""
    return [f"d{i}" for i in range(n_x)] + ["d_" + n for n in REPLICATED if n in kw]
