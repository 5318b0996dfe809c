"""The decode steps (``kda_step``, ``gated_diag_step``, Triton backend) captured in a CUDA graph (marked `gpu`).

Each step is captured once with static input buffers, a state pool and ``state_indices`` (B,) or (B, T) with
``num_accepted_tokens``; the graph is replayed several times with new tokens, new accepted counts and new slot
tables copied into the buffers, and every replay must equal (bit for bit) the same eager call on a mirror pool.
Capture and replays run under ``torch.cuda.set_sync_debug_mode("error")``: a host synchronisation in the
captured path raises. The eager calls are checked against the reference backend too.
"""
import contextlib

import pytest
import torch

import delta_attn as da

DEV = "cuda"
REPLAYS = 3


@contextlib.contextmanager
def _no_sync():
    """Any synchronising call (``.item()``, ``.tolist()``, ``nonzero``, blocking copies) raises inside."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _Step:
    """One decode operator's static buffers and its call."""

    def __init__(self, which, B, T, dims, dtype, P, gen):
        self.which, self.B, self.T, self.dtype, self.gen = which, B, T, dtype, gen
        if which == "kda":
            H, HV, K, V = dims
            self.shapes = [(B, T, H, K), (B, T, H, K), (B, T, HV, V), (B, T, HV, K), (B, T, HV)]
            self.state_shape = (HV, K, V)
        else:
            H, D = dims
            self.shapes = [(B, T, H, D)] * 4
            self.state_shape = (H, D)
        self.bufs = [torch.empty(s, device=DEV, dtype=dtype) for s in self.shapes]
        self.pool = torch.randn(P, *self.state_shape, device=DEV, generator=gen) * 0.3

    def fresh_tokens(self):
        xs = [torch.randn(s, device=DEV, generator=self.gen) for s in self.shapes]
        if self.which == "kda":
            xs[1] = torch.nn.functional.normalize(xs[1], dim=-1)
            xs[3] = torch.nn.functional.logsigmoid(xs[3] + 2.0)
            xs[4] = torch.rand(self.shapes[4], device=DEV, generator=self.gen)
        else:
            xs[3] = -torch.rand(self.shapes[3], device=DEV, generator=self.gen)
        return [x.to(self.dtype) for x in xs]

    def __call__(self, xs, pool, backend="triton", **slots):
        if self.which == "kda":
            return da.kda_step(*xs, pool, use_qk_l2norm=True, backend=backend, **slots)
        return da.gated_diag_step(*xs, pool, backend=backend, **slots)


CASES = [("kda", (2, 4, 128, 128)), ("kda", (1, 2, 96, 80)), ("diag", (4, 128)), ("diag", (3, 100))]


@pytest.mark.parametrize("which,dims", CASES, ids=[f"{w}-{'x'.join(map(str, d))}" for w, d in CASES])
@pytest.mark.parametrize("layout", ["per sequence", "speculative"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_captured_step_replays_equal_eager(which, dims, layout, dtype):
    gen = torch.Generator(device=DEV).manual_seed(1)
    B, T = 7, (1 if layout == "per sequence" else 4)
    P = B * T + 5
    step = _Step(which, B, T, dims, dtype, P, gen)
    if layout == "per sequence":
        idx = torch.randperm(P, device=DEV, generator=gen)[:B].to(torch.int32)
        nat = None
    else:
        idx = torch.randperm(P, device=DEV, generator=gen)[:B * T].view(B, T).to(torch.int32)
        nat = torch.ones(B, device=DEV, dtype=torch.int32)
    slots = dict(state_indices=idx) if nat is None else dict(state_indices=idx, num_accepted_tokens=nat)
    for b, x in zip(step.bufs, step.fresh_tokens()):
        b.copy_(x)

    # warm-up (compilation) on a side stream, on a copy of the pool, as torch.cuda.graphs asks
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(step.bufs, step.pool.clone(), **slots)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    start = step.pool.clone()
    with torch.cuda.graph(graph):
        with _no_sync():
            o_static = step(step.bufs, step.pool, **slots)
    step.pool.copy_(start)              # capture ran nothing: the pool is as it was, but be explicit
    mirror = step.pool.clone()

    for r in range(REPLAYS):
        xs = step.fresh_tokens()
        for b, x in zip(step.bufs, xs):
            b.copy_(x)
        if layout == "speculative":      # the last verification's accepted counts, and a reshuffled table
            nat.copy_(torch.randint(1, T + 1, (B,), device=DEV, generator=gen, dtype=torch.int32))
            if r == 1:
                perm = torch.randperm(P, device=DEV, generator=gen)[:B * T].view(B, T).to(torch.int32)
                mirror[perm.long()] = mirror[idx.long()]      # the engine moved the states with the slots
                step.pool.copy_(mirror)
                idx.copy_(perm)
        eager_slots = {n: t.clone() for n, t in slots.items()}
        ref_pool = mirror.clone()
        o_eager = step(xs, mirror, **eager_slots)
        with _no_sync():
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_static, o_eager), f"replay {r}: o differs from eager"
        assert torch.equal(step.pool, mirror), f"replay {r}: the pool differs from eager"
        # the eager kernel against the reference backend (fp32 arithmetic on the same inputs)
        o_ref = step(xs, ref_pool, backend="torch", **eager_slots)
        torch.testing.assert_close(o_eager.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(mirror, ref_pool, atol=2e-4, rtol=2e-4)


def test_capture_without_indices_and_several_tokens():
    """No state_indices (slot b is state[b]) and T = 3 tokens, KDA with the in-kernel gate."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    B, T, H, HV, K, V = 5, 3, 2, 4, 64, 128
    step = _Step("kda", B, T, (H, HV, K, V), torch.bfloat16, B, gen)
    a_log, dt_bias = torch.randn(HV, device=DEV) * 0.5, torch.randn(HV * K, device=DEV) * 0.5
    call = lambda xs, pool: da.kda_step(*xs, pool, use_qk_l2norm=True, A_log=a_log, dt_bias=dt_bias,  # noqa: E731
                                        backend="triton")
    for b, x in zip(step.bufs, step.fresh_tokens()):
        b.copy_(x)
    call(step.bufs, step.pool.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with _no_sync():
            o_static = call(step.bufs, step.pool)
    mirror = step.pool.clone()
    for r in range(REPLAYS):
        xs = step.fresh_tokens()
        for b, x in zip(step.bufs, xs):
            b.copy_(x)
        o_eager = call(xs, mirror)
        with _no_sync():
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_static, o_eager) and torch.equal(step.pool, mirror), f"replay {r}"


def test_eager_value_checks_are_the_only_host_sync():
    """Outside capture the slot checks read the values (one sync, caught by the debug mode); with the values
    already checked the launch itself never synchronises."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    step = _Step("diag", 4, 2, (2, 64), torch.bfloat16, 12, gen)
    idx = torch.arange(8, device=DEV, dtype=torch.int32).view(4, 2)
    xs = step.fresh_tokens()
    step(xs, step.pool, state_indices=idx)
    with pytest.raises(RuntimeError, match="synchroniz"):
        with _no_sync():
            step(xs, step.pool, state_indices=idx)
    from delta_attn.ops.diag.launch import diag_step
    with _no_sync():
        diag_step(*xs, step.pool, idx)
    torch.cuda.synchronize()
