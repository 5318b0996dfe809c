"""Plans (``dd.prepare``) on 2 and 3 gloo ranks: a call given a plan reads nothing on the host, computes what
the same call without one computes, and refuses a plan built for another call.

The host-read detector (:func:`no_host_reads`) patches, for the duration of a block, every ``torch`` method
that hands a tensor's values to Python (``tolist``, ``item``, ``cpu``, ``numpy``, ``__bool__`` / ``__int__``
/ ``__float__`` / ``__index__``, ``nonzero``, ``equal``, ``allclose``) and ``torch.tensor`` /
``torch.as_tensor`` (a host-to-device copy on a GPU), to raise when called from delta-attn's code. On CPU
every tensor is a host tensor, so the detector cannot tell a device read from a host one; it therefore flags
every such call made by the package, except in :func:`delta_attn.distributed.plan.upload` (pinned,
non-blocking). KDA's chunk tables come from the plan (built by ``dd.prepare`` for a packed batch, from host
integers at the first call for a dense one), so the KDA calls are checked whole. The Triton interpreter's own
code is not the package's and is not flagged. On a GPU the same property is checked
with ``torch.cuda.set_sync_debug_mode("error")`` (tests/gpu/test_distributed_linear_gpu.py).
"""
import contextlib
import os
import sys

import pytest
import torch

import delta_attn
from distributed_harness import run_ranks

_PKG = os.path.dirname(os.path.abspath(delta_attn.__file__)) + os.sep
_METHODS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "equal",
            "allclose")
_FUNCTIONS = ("tensor", "as_tensor", "equal", "allclose", "nonzero")


class HostRead(AssertionError):
    pass


def _flag(name, frame):
    path = os.path.abspath(frame.f_code.co_filename)
    if not path.startswith(_PKG):
        return
    if frame.f_code.co_name == "upload" and path.endswith(os.path.join("distributed", "plan.py")):
        return
    raise HostRead(f"host read: {name} called from {path}:{frame.f_lineno} ({frame.f_code.co_name})")


@contextlib.contextmanager
def no_host_reads():
    """Inside the block, delta-attn code that reads a tensor's values on the host raises HostRead."""
    saved = []

    def wrap(owner, name):
        orig = getattr(owner, name)

        def patched(*a, **kw):
            _flag(f"{getattr(owner, '__name__', owner)}.{name}", sys._getframe(1))
            return orig(*a, **kw)
        saved.append((owner, name, orig))
        setattr(owner, name, patched)

    for m in _METHODS:
        wrap(torch.Tensor, m)
    for f in _FUNCTIONS:
        wrap(torch, f)
    try:
        yield
    finally:
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)


def _detector_sees(fn):
    """``fn()`` under the detector; True when it read the host."""
    try:
        with no_host_reads():
            fn()
    except HostRead:
        return True
    return False


# ---------------------------------------------------------------------------------------------
# the calls: every context-parallel op, dense and packed, with and without a plan
# ---------------------------------------------------------------------------------------------

def _full(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def _linear_case(op, world, varlen, t_local=4):
    """Full inputs (every rank the same), keywords; dense B = 2, packed: sequences spanning ranks, one empty."""
    total = world * t_local
    b = 1 if varlen else 2
    kw = dict(output_final_state=True)
    if varlen:
        kw["cu_seqlens"] = torch.tensor([0, 1, t_local + 2, t_local + 2, total], dtype=torch.int32)
    n = 4 if varlen else b
    if op == "kda":
        q, k = _full(1, b, total, 1, 16), _full(2, b, total, 1, 16) * 0.25
        v = _full(3, b, total, 1, 16)
        g = torch.nn.functional.logsigmoid(_full(4, b, total, 1, 16) + 2.0)
        beta = torch.sigmoid(_full(5, b, total, 1))
        kw["initial_state"] = _full(6, n, 1, 16, 16) * 0.3
        return [q, k, v, g, beta], kw
    q, k, v = (_full(i, b, total, 2, 16) for i in (1, 2, 3))
    g = torch.nn.functional.logsigmoid(_full(4, b, total, 2, 16) + 2.0)
    kw["initial_state"] = _full(6, n, 2, 16) * 0.5
    return [q, k, v, g], kw


def _run(fn, xs, kw, backward=True):
    """(outputs, gradients of the shards and of initial_state) of one call on this rank's shards."""
    import delta_attn.distributed as dd
    loc = [dd.shard(x).detach().requires_grad_() for x in xs]
    h0 = kw.get("initial_state")
    kw = dict(kw)
    if h0 is not None:
        kw["initial_state"] = h0.detach().clone().requires_grad_()
    o, f = fn(*loc, **kw)
    grads = ()
    if backward:
        loss = (o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() + (f.sin().sum() if f is not None else 0)
        grads = torch.autograd.grad(loss, loc + ([kw["initial_state"]] if h0 is not None else []), allow_unused=True)
    return (o, f) + tuple(grads)


def _same(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{what} [{i}]"
            continue
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m: f"{what} [{i}]: {m}")


def _linear_calls(rank, world):
    import delta_attn.distributed as dd
    for op, fn in (("kda", dd.kda), ("diag", dd.gated_diag_attn)):
        for varlen in (False, True):
            xs, kw = _linear_case(op, world, varlen)
            cu = kw.pop("cu_seqlens", None)
            t_total = xs[0].shape[1]
            plan = dd.prepare(cu_seqlens=cu, seqlen=t_total)
            for scheme in (("allgather", "ring")[varlen ^ (op == "diag")],):   # each scheme once per op
                what = f"{op} varlen={varlen} {scheme} rank {rank}/{world}"
                common = dict(kw, backend="triton", state_passing=scheme)
                want = _run(lambda *a, **k: fn(*a, cu_seqlens=cu, **k), xs, common)
                with no_host_reads():
                    got = _run(lambda *a, **k: fn(*a, plan=plan, **k), xs, common)
                _same(got, want, what)
                if varlen:      # the same call without a plan reads cu_seqlens on the host
                    assert _detector_sees(lambda: _run(lambda *a, **k: fn(*a, cu_seqlens=cu, **k), xs, common,
                                                       backward=False)), what
                    # and with both: the plan's tables, cu_seqlens only checked for its length
                    with no_host_reads():
                        both = _run(lambda *a, **k: fn(*a, cu_seqlens=cu, plan=plan, **k), xs, common)
                    _same(both, want, what + " (cu_seqlens and plan)")


def _attention_calls(rank, world):
    import delta_attn.distributed as dd
    t_local = 4
    # dense, zigzag, causal
    q, k, v = (_full(i, 1, 2 * t_local * world, 2, 16).half() for i in (1, 2, 3))
    plan = dd.prepare(seqlen=q.shape[1], layout="zigzag")

    def dense(**extra):
        loc = [dd.shard(x, layout="zigzag").detach().requires_grad_() for x in (q, k, v)]
        o = dd.flash_attn_func(*loc, causal=True, backend="triton", **extra)
        return (o,) + torch.autograd.grad(o.float().sum(), loc)

    want = dense(layout="zigzag")
    with no_host_reads():
        got = dense(plan=plan)
    _same(got, want, f"flash dense rank {rank}")
    # packed, contiguous and zigzag shards, a sequence spanning ranks, distinct key offsets
    total = 2 * t_local * world
    cu = torch.tensor([0, 3, total - 2, total], dtype=torch.int32)
    cu_k = torch.tensor([0, 2, 2 * total - 1, 2 * total], dtype=torch.int32)
    qv = _full(4, total, 2, 16).half()
    kv, vv = _full(5, 2 * total, 1, 16).half(), _full(6, 2 * total, 1, 16).half()
    for shard_layout in ("contiguous", "zigzag"):
        plan = dd.prepare(cu_seqlens=cu, cu_seqlens_k=cu_k, layout=shard_layout)

        def packed(cq, ck, mq, mk, **extra):
            loc = [dd.shard(x, dim=0, layout=shard_layout).detach().requires_grad_() for x in (qv, kv, vv)]
            o = dd.flash_attn_varlen_func(*loc, cq, ck, mq, mk, causal=True, backend="triton", **extra)
            return (o,) + torch.autograd.grad(o.float().sum(), loc)

        want = packed(cu, cu_k, total, 2 * total, shard_layout=shard_layout)
        with no_host_reads():
            got = packed(None, None, None, None, plan=plan)
            got2 = packed(cu, cu_k, total, 2 * total, plan=plan)
        _same(got, want, f"flash varlen {shard_layout} rank {rank}")
        _same(got2, want, f"flash varlen {shard_layout} (offsets given too) rank {rank}")
        assert _detector_sees(lambda: packed(cu, cu_k, total, 2 * total, shard_layout=shard_layout))


def _refusals(rank, world):
    import torch.distributed as dist
    import delta_attn.distributed as dd
    xs, kw = _linear_case("diag", world, False)
    loc = [dd.shard(x) for x in xs]
    t = xs[0].shape[1]
    with pytest.raises(ValueError, match="local tokens per rank"):
        dd.gated_diag_attn(*loc, plan=dd.prepare(seqlen=2 * t))
    with pytest.raises(ValueError, match="a dense batch"):
        dd.gated_diag_attn(*(x[:1] for x in loc), cu_seqlens=torch.tensor([0, t], dtype=torch.int32),
                           plan=dd.prepare(seqlen=t))
    packed = dd.prepare(cu_seqlens=torch.tensor([0, 1, t], dtype=torch.int32))
    with pytest.raises(ValueError, match="3 cu_seqlens entries, but the call passes 4"):
        dd.kda(*(x[:1] for x in loc), loc[3][:1, :, :, 0], cu_seqlens=torch.tensor([0, 1, 2, t], dtype=torch.int32),
               plan=packed)
    with pytest.raises(ValueError, match="B == 1"):
        dd.gated_diag_attn(*loc, plan=packed)
    with pytest.raises(ValueError, match="contiguous layout only"):
        dd.gated_diag_attn(*loc, plan=dd.prepare(seqlen=t, layout="zigzag"))
    with pytest.raises(ValueError, match="device"):
        dd.gated_diag_attn(*loc, plan=dd.prepare(seqlen=t, device="meta"))
    other = dist.new_group(list(range(world)))
    with pytest.raises(ValueError, match="another process group"):
        dd.gated_diag_attn(*loc, plan=dd.prepare(seqlen=t, group=other))
    with pytest.raises(TypeError, match="dd.prepare"):
        dd.gated_diag_attn(*loc, plan={"seqlen": t})
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="layout='zigzag'"):
        dd.flash_attn_func(q, q, q, layout="contiguous", plan=dd.prepare(seqlen=4 * world, layout="zigzag"))
    with pytest.raises(ValueError, match="local keys per rank"):
        dd.flash_attn_func(q, q[:, :2], q[:, :2], plan=dd.prepare(seqlen=4 * world))
    x = torch.zeros(4, 2, 8)
    cu = torch.tensor([0, 4 * world], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        dd.flash_attn_varlen_func(x, x, x, cu, cu, 3, 4 * world, plan=dd.prepare(cu_seqlens=cu))
    # prepare's own checks
    with pytest.raises(ValueError, match="divisible by"):
        dd.prepare(seqlen=world + 1)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]"):
        dd.prepare(cu_seqlens=[0, 3], seqlen=4 * world)
    with pytest.raises(ValueError, match="non-decreasing"):
        dd.prepare(cu_seqlens=[0, 3, 2, 2 * world])
    with pytest.raises(ValueError, match="seqlen"):
        dd.prepare()


def _body(rank, world, attention):
    _linear_calls(rank, world)
    if attention:
        _attention_calls(rank, world)
    _refusals(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_plan_calls_read_nothing_on_the_host(world):
    """Every op with a plan: no host read in the forward or the backward, the results of the call without
    one (bit for bit), and without a plan a packed call reads the host (the detector sees it)."""
    pytest.importorskip("triton")
    run_ranks(world, _body, world == 2)


def test_plan_tables():
    """The linear plan's carry tables for a packed batch, on the host (no process group needed)."""
    from delta_attn.distributed.plan import _dense_linear, _varlen_linear
    # 3 ranks of 4 tokens: sequence 0 = [0, 2), 1 = [2, 10) (ranks 0..2, passes through rank 1), 2 = [10, 12)
    cu = [0, 2, 10, 12]
    tables = [_varlen_linear(cu, r, 3, 4, torch.device("cpu")) for r in range(3)]
    assert tables[0].cont == (False, True, True) and tables[0].passes == (False, True, False)
    assert tables[0].hands_on == (True, True, False)
    assert [t.n_pieces for t in tables] == [2, 1, 2]
    assert tables[1].carry_chain(1) == range(0, 1) and tables[2].carry_chain(2) == range(0, 2)
    assert tables[0].grad_chain(0) == range(1, 3) and tables[1].grad_chain(1) == range(2, 3)
    assert tables[2].first_len == 2 and tables[2].last_start == 2
    assert tables[2].owned.tolist() == [0, 1] and tables[0].owned.tolist() == [0]
    # final states: sequence 0 on rank 0 (slot 0), 1 and 2 on rank 2 (slots 0, 1); max 2 per rank
    assert tables[0].final_index.tolist() == [0, 4, 5]
    # a boundary on the shard edge: nothing crosses, nobody exchanges
    edge = _varlen_linear([0, 4, 12], 1, 3, 4, torch.device("cpu"))
    assert edge.cont == (False, False, True) and not edge.passes[1] and edge.hands_on == (False, True, False)
    dense = _dense_linear(1, 3, 4)
    assert dense.cont == (False, True, True) and dense.passes == (False, True, False) and dense.any_carry
