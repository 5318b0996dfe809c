"""dd.shard / dd.unshard and the layout helpers on 2 and 3 gloo ranks (spawned once per world size)."""
import pytest
import torch

import delta_attn.distributed as dd
from delta_attn.distributed import sharding

from distributed_harness import run_ranks


def _sharding_body(rank, world):
    import torch.distributed as dist
    for layout in ("contiguous", "zigzag"):
        for seed, (shape, dim) in enumerate((((2, 4 * world, 3, 5), 1), ((6 * world, 2), 0), ((3, 2, 2 * world), -1))):
            torch.manual_seed(seed)
            x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
            loc = dd.shard(x, dim=dim, layout=layout)
            pos = dd.positions(loc.shape[dim], rank, world, layout)
            torch.testing.assert_close(loc, x.index_select(dim, pos), rtol=0, atol=0)
            full = dd.unshard(loc, dim=dim, layout=layout)
            torch.testing.assert_close(full, x, rtol=0, atol=0)
            # gradients: every rank weights the full tensor differently; the shard's gradient is the sum
            w = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + rank))
            loc_leaf = loc.detach().requires_grad_()
            (dd.unshard(loc_leaf, dim=dim, layout=layout) * w).sum().backward()
            w_sum = w.clone()
            dist.all_reduce(w_sum)
            torch.testing.assert_close(loc_leaf.grad, w_sum.index_select(dim, pos), rtol=1e-12, atol=1e-12)
    # the sequence must divide: a clear ValueError naming the rule
    with pytest.raises(ValueError, match="divisible by"):
        dd.shard(torch.zeros(1, 2 * world + 1, 1, 1))
    with pytest.raises(ValueError, match="2 x world size"):
        dd.shard(torch.zeros(1, 3 * world, 1, 1), layout="zigzag")
    with pytest.raises(ValueError, match="layout"):
        dd.shard(torch.zeros(1, world, 1, 1), layout="ring")
    with pytest.raises(ValueError, match="dim"):
        dd.unshard(torch.zeros(1, 2), dim=2)


@pytest.mark.parametrize("world", [2, 3])
def test_shard_unshard(world):
    run_ranks(world, _sharding_body)


def test_layout_helpers():
    assert dd.zigzag_chunks(0, 4) == (0, 7) and dd.zigzag_chunks(3, 4) == (3, 4)
    assert dd.chunk_ranges(4, 1, 2, "zigzag") == ((2, 4), (4, 6))
    assert dd.chunk_ranges(4, 1, 3) == ((4, 8),)
    assert dd.local_length(12, 3) == 4 and dd.local_length(12, 3, "zigzag") == 4
    # the zigzag chunks of all ranks tile the sequence exactly once
    world, t_local = 4, 6
    allpos = torch.cat([dd.positions(t_local, r, world, "zigzag") for r in range(world)])
    assert sorted(allpos.tolist()) == list(range(world * t_local))
    with pytest.raises(ValueError, match="rank"):
        dd.zigzag_chunks(4, 4)
    with pytest.raises(ValueError, match="layout"):
        sharding.check_layout("striped")


def test_needs_process_group():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        dd.shard(torch.zeros(1, 4, 1, 1))
