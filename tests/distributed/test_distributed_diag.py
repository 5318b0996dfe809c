"""The exchange-first gated diagonal operator (``delta_attn/distributed/diag.py``) on its Triton path, under
the interpreter: the summary kernel against torch, the context-parallel operator against the float64
reference on 2 and 3 gloo ranks (dense and packed, both exchanges, carries through whole ranks), and what it
keeps for the backward against the single-GPU operator on the same shard."""
import pytest
import torch

from distributed_harness import run_ranks, saved_bytes

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("edge", [False, True])
def test_summary_kernel_matches_torch(reverse, edge):
    """``diag_summary`` (one chunk, and many chunks combined by the second launch) against the torch summary
    of the float64 path, on rows [t0, t1) of 2 batch rows with a masked channel block (H * D = 15)."""
    from delta_attn.distributed.diag import _Local
    from delta_attn.ops.diag import launch as T
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 2, 29, 3, 5, generator=gen).unbind(0)
    g = torch.nn.functional.logsigmoid(torch.randn(2, 29, 3, 5, generator=gen) + 2.0)
    e = torch.randn(2, 3, 5, generator=gen) if edge else None
    want = _Local("torch").summary(x, y, g, 4, 27, e, reverse, torch.float64)
    many = T.SummaryConfig(bt=2, bd=16, warps=1, programs_per_sm=8, min_chunk_steps=1)
    for cfg in (None, many):
        got = T.diag_summary(x, y, g, 4, 27, e, reverse, config=cfg)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    m, s = T.diag_summary(x, y, g, 5, 5, e, reverse)           # no rows: decay 1, the edge itself
    assert torch.equal(m, torch.ones_like(m)) and torch.equal(s, e if edge else torch.zeros_like(s))


# (op keywords) per world size: dense with an initial state, packed with a sequence through a whole rank
def _cases(world):
    t_local = 6
    total = world * t_local
    return [
        dict(varlen=None, scheme="allgather", t_local=t_local),
        dict(varlen=None, scheme="ring", t_local=t_local),
        # sequences: [0, 1), [1, total - 2) (through every middle rank), empty, [total - 2, total)
        dict(varlen=[0, 1, total - 2, total - 2, total], scheme="ring", t_local=t_local),
        # a boundary on the first shard edge (W = 2: nothing crosses)
        dict(varlen=[0, t_local, total], scheme="allgather", t_local=t_local),
    ]


def _reference_body(rank, world):
    import delta_attn.distributed as dd
    import sharded_grads as L
    from delta_attn import reference
    from delta_attn.testing import check
    for i, c in enumerate(_cases(world)):
        gen = torch.Generator().manual_seed(i)
        total, b = world * c["t_local"], (1 if c["varlen"] else 2)
        xs = [torch.randn(b, total, 2, 16, generator=gen) for _ in range(3)]
        xs.append(torch.nn.functional.logsigmoid(torch.randn(b, total, 2, 16, generator=gen) + 2.0))
        kw = dict(output_final_state=True)
        n = b
        if c["varlen"]:
            kw["cu_seqlens"] = torch.tensor(c["varlen"], dtype=torch.int32)
            n = len(c["varlen"]) - 1
        kw["initial_state"] = torch.randn(n, 2, 16, generator=gen) * 0.5
        w = L.loss_weights(i, xs[0].shape, (n, 2, 16))
        got = L.sharded(dd.gated_diag_attn, xs, kw, w, world, backend="triton", state_passing=c["scheme"])
        r64 = L.single_process(reference.gated_diag, [x.double() for x in xs],
                               {k: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t)
                                for k, t in kw.items()}, w)
        low = L.single_process(reference.gated_diag, xs, kw, w, upcast=False)
        rows = [("o", got[0], dd.shard(r64[0]), dd.shard(low[0]), "fwd"), ("final", got[1], r64[1], low[1], "fwd")]
        rows += [(nm, a, dd.shard(r) if j < 4 else r, dd.shard(lw) if j < 4 else lw, "grad")
                 for j, (nm, a, r, lw) in enumerate(zip(L.grad_names(kw, 4), got[2], r64[2], low[2]))]
        bad = [v.message for v in (check(a, r, lw, kind=kd, name=nm) for nm, a, r, lw, kd in rows) if not v.ok]
        assert not bad, f"rank {rank}/{world} case {c}: " + "; ".join(bad)


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_first_matches_reference(world):
    run_ranks(world, _reference_body)


def _memory_body(rank, world):
    import delta_attn as da
    import delta_attn.distributed as dd
    t_local, b, h, d = 32, 2, 2, 16
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(b, world * t_local, h, d, generator=gen) for _ in range(4)]
    full[3] = torch.nn.functional.logsigmoid(full[3])          # g: a log decay <= 0
    loc = [dd.shard(x).detach().requires_grad_() for x in full]
    for scheme in ("allgather", "ring"):
        cp, _ = saved_bytes(lambda: dd.gated_diag_attn(*loc, backend="triton", state_passing=scheme)[0])
        one, _ = saved_bytes(lambda: da.gated_diag_attn(*loc, backend="triton")[0])
        assert cp <= 1.25 * one, f"rank {rank}: the context-parallel backward keeps {cp} bytes, the operator {one}"


def test_saved_for_backward_is_the_operators():
    """What the context-parallel forward keeps for its backward: q, k, v, g and the operator's workspace, as
    the single-GPU operator on the shard, plus (rows, H, D) states (the old scheme kept copies at twice the
    heads)."""
    run_ranks(2, _memory_body)
