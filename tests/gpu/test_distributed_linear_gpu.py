"""dd.kda / dd.gated_diag_attn on CUDA with backend="triton" (bf16, fp16) against the float64 reference
(the error rule of docs/TESTING.md; outputs, final states, every gradient), half the configurations given the
batch's plan (``dd.prepare``):

- world size 1 over NCCL in this process (the path a single-GPU job with context parallelism takes);
- 2 and 3 ranks sharing the one GPU over gloo (gloo moves CUDA tensors through the host): the state
  passing proper (KDA: the local pass with the transition scan, the exchange, the carry folded in by kernels,
  one backward; diagonal: summary kernels, exchange, one pass at the true state and its mirrored backward) on
  the real kernels, all-gather scheme;
- 2+ ranks over NCCL, one GPU each, both schemes, when several GPUs are visible; there also: calls given a
  plan make no host synchronisation (``torch.cuda.set_sync_debug_mode("error")``, forward and backward), and
  each linear operator's peak memory in fwd+bwd is at most 1.25 x the single-GPU operator's on the shard.
"""
import random

import pytest
import torch
import torch.distributed as dist

from distributed_harness import run_ranks

_REPL = ("initial_state", "A_log", "dt_bias")


def _configs(world, schemes):
    r = random.Random(world)
    out = []
    for i, (op, dt, kd, vd) in enumerate([("kda", torch.bfloat16, 64, 64), ("kda", torch.float16, 128, 128),
                                         ("kda", torch.bfloat16, 128, 256),     # V = 256, the transition at K
                                         ("diag", torch.bfloat16, 64, 64), ("diag", torch.float16, 128, 128)]):
        for varlen in (False, True):
            out.append(dict(op=op, dt=dt, kd=kd, vd=vd, varlen=varlen, t_local=r.choice([97, 130, 200]),
                            scheme=schemes[i % len(schemes)], gate=op == "kda" and i % 2 == 0, seed=10 * i + varlen))
    return out


def _inputs(c, world, device):
    gen = torch.Generator(device=device).manual_seed(c["seed"])
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=torch.float64)   # noqa: E731
    total = world * c["t_local"]
    b = 1 if c["varlen"] else 2
    kw = {"output_final_state": True}
    if c["varlen"]:
        lens = [total // 3, 1, 0, total // 2]
        lens.append(total - sum(lens))
        kw["cu_seqlens"] = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    n = len(kw["cu_seqlens"]) - 1 if c["varlen"] else b
    if c["op"] == "kda":
        h, hv = 2, 4
        q, k, v = rnd(b, total, h, c["kd"]), rnd(b, total, h, c["kd"]), rnd(b, total, hv, c["vd"])
        if c["gate"]:
            g = rnd(b, total, hv, c["kd"])
            kw.update(A_log=rnd(hv).float() * 0.5, dt_bias=rnd(hv * c["kd"]).float() * 0.5)
        else:
            g = torch.nn.functional.logsigmoid(rnd(b, total, hv, c["kd"]) + 3.0)
        xs = [q, k, v, g, torch.rand(b, total, hv, generator=gen, device=device, dtype=torch.float64)]
        kw["use_qk_l2norm"] = True
        kw["initial_state"] = (rnd(n, hv, c["kd"], c["vd"]) * 0.3).float()
    else:
        h, d = 4, c["kd"]
        xs = [rnd(b, total, h, d) for _ in range(3)] + [torch.nn.functional.logsigmoid(rnd(b, total, h, d) + 3.0)]
        kw["initial_state"] = rnd(n, h, d).float()
    return [x.to(c["dt"]) for x in xs], kw


def _body(rank, world, schemes, device_type="cuda", backend="triton"):
    import delta_attn.distributed as dd
    import sharded_grads as L
    from delta_attn import reference
    from delta_attn.testing import check
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    for c in _configs(world, schemes):
        xs, kw = _inputs(c, world, device)
        fn_dd = dd.kda if c["op"] == "kda" else dd.gated_diag_attn
        fn_ref = reference.kda if c["op"] == "kda" else reference.gated_diag
        o_shape = xs[0].shape[:2] + xs[2].shape[2:]
        gen = torch.Generator(device=device).manual_seed(1000 + c["seed"])
        w = (torch.randn(o_shape, generator=gen, device=device, dtype=torch.float64),
             torch.randn(kw["initial_state"].shape, generator=gen, device=device, dtype=torch.float64))
        extra = {}
        if c["seed"] % 2:           # half the configurations with the batch's plan
            extra["plan"] = dd.prepare(seqlen=xs[0].shape[1], cu_seqlens=kw.get("cu_seqlens"), device=device)
        got = L.sharded(fn_dd, xs, kw, w, world, backend=backend, state_passing=c["scheme"], **extra)
        r64 = L.single_process(fn_ref, [x.double() for x in xs],
                               {k: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t)
                                for k, t in kw.items()}, w)
        low = L.single_process(fn_ref, xs, kw, w, upcast=False)
        names = ["o", "final"] + L.grad_names(kw, len(xs))
        nx = len(xs)
        bad = []
        for i, nm in enumerate(names):
            a, b_, c_ = (got[i], r64[i], low[i]) if i < 2 else (got[2][i - 2], r64[2][i - 2], low[2][i - 2])
            if i == 0 or (2 <= i < 2 + nx):
                b_, c_ = dd.shard(b_), dd.shard(c_)
            v = check(a, b_, c_, kind="fwd" if i < 2 else "grad", name=nm)
            if not v.ok:
                bad.append(v.message)
        assert not bad, f"rank {rank}/{world} {c}: " + "; ".join(bad)


def test_world_size_one_nccl():
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _body(0, dist.get_world_size(), ("allgather", "ring"))
    finally:
        if own:
            dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sharing_one_gpu_gloo(world):
    run_ranks(world, _gloo_on_gpu0, timeout=900, start="spawn")


def _gloo_on_gpu0(rank, world):
    torch.cuda.set_device(0)
    _body(rank, world, ("allgather",))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_multi_gpu_nccl():
    world = min(torch.cuda.device_count(), 4)
    run_ranks(world, _body, ("allgather", "ring"), backend="nccl", timeout=900, start="spawn")


# ---------------------------------------------------------------------------------------------
# no host synchronisation with a plan; the diagonal operator's memory
# ---------------------------------------------------------------------------------------------

def _sync_free_calls(world, ops, dev=None, t_local=256, dt=torch.bfloat16):
    """(name, call) pairs: fwd + bwd of each op given its plan, at modest sizes (one GPU per rank)."""
    import delta_attn.distributed as dd
    dev = dev or torch.device("cuda", torch.cuda.current_device())
    total = t_local * world
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev)    # noqa: E731
    cu = torch.tensor([0, t_local // 3, total - t_local // 5, total], dtype=torch.int32, device=dev)
    out = []

    def leaves(*xs):
        return [x.detach().requires_grad_() for x in xs]

    for varlen in (False, True):
        b = 1 if varlen else 2
        plan = dd.prepare(seqlen=total, cu_seqlens=cu if varlen else None, device=dev)
        kw = dict(plan=plan, backend="triton", output_final_state=True)
        if "diag" in ops:
            x = [rnd(b, t_local, 4, 64).to(dt) for _ in range(3)] + [
                torch.nn.functional.logsigmoid(rnd(b, t_local, 4, 64) + 3.0).to(dt)]
            for sp in ("allgather", "ring"):
                def diag(x=x, sp=sp, kw=kw):
                    loc = leaves(*x)
                    o, f = dd.gated_diag_attn(*loc, state_passing=sp, **kw)
                    torch.autograd.grad(o.float().sum() + f.sum(), loc)
                out.append((f"diag varlen={varlen} {sp}", diag))
        if "kda" in ops:
            x = [rnd(b, t_local, 2, 64).to(dt) for _ in range(3)] + [
                torch.nn.functional.logsigmoid(rnd(b, t_local, 2, 64) + 3.0).to(dt),
                torch.rand(b, t_local, 2, generator=gen, device=dev).to(dt)]

            def kda(x=x, kw=kw):
                loc = leaves(*x)
                o, f = dd.kda(*loc, use_qk_l2norm=True, **kw)
                torch.autograd.grad(o.float().sum() + f.sum(), loc)
            out.append((f"kda varlen={varlen}", kda))
    if "flash" in ops:
        q, k, v = (rnd(1, 2 * t_local, 4, 64).to(dt) for _ in range(3))
        plan = dd.prepare(seqlen=2 * total, layout="zigzag", device=dev)

        def dense():
            loc = leaves(q, k, v)
            o = dd.flash_attn_func(*loc, causal=True, plan=plan, backend="triton")
            torch.autograd.grad(o.float().sum(), loc)
        out.append(("flash dense zigzag", dense))
        qv, kv, vv = (rnd(t_local, 4, 64).to(dt) for _ in range(3))
        vplan = dd.prepare(cu_seqlens=cu, device=dev)

        def packed():
            loc = leaves(qv, kv, vv)
            o = dd.flash_attn_varlen_func(*loc, None, None, None, None, causal=True, plan=vplan, backend="triton")
            torch.autograd.grad(o.float().sum(), loc)
        out.append(("flash varlen", packed))
    return out


def _assert_sync_free(calls):
    for _, call in calls:
        call()                              # first calls: compile, autotune, plan the calls
    torch.cuda.synchronize()
    bad = []
    for name, call in calls:
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        except RuntimeError as e:
            bad.append(f"{name}: {e}")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert not bad, "host synchronisations in calls given a plan:\n" + "\n".join(bad)


def _sync_free_body(rank, world):
    _assert_sync_free(_sync_free_calls(world, ("diag", "flash")))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_plan_calls_do_not_synchronise_nccl():
    """dd.gated_diag_attn (dense / packed, both exchanges) and dd.flash_attn_func / flash_attn_varlen_func given
    a plan, forward and backward on 2 GPUs, under torch.cuda.set_sync_debug_mode("error")."""
    run_ranks(2, _sync_free_body, backend="nccl", timeout=900, start="spawn")


def _kda_sync_body(rank, world):
    _assert_sync_free(_sync_free_calls(world, ("kda",)))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_kda_plan_calls_do_not_synchronise_nccl():
    run_ranks(2, _kda_sync_body, backend="nccl", timeout=900, start="spawn")


def _memory_body(rank, world, op):
    import delta_attn as da
    import delta_attn.distributed as dd
    dev = torch.device("cuda", torch.cuda.current_device())
    t_local, h, d = 16384, 16, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    x = [torch.randn(1, t_local, h, d, generator=gen, device=dev).bfloat16() for _ in range(3)]
    x.append(torch.nn.functional.logsigmoid(torch.randn(1, t_local, h, d, generator=gen, device=dev) + 3.0).bfloat16())
    if op == "kda":
        x.append(torch.rand(1, t_local, h, generator=gen, device=dev).bfloat16())
    fn_single, fn_cp = (da.kda, dd.kda) if op == "kda" else (da.gated_diag_attn, dd.gated_diag_attn)
    plan = dd.prepare(seqlen=world * t_local, device=dev)

    def peak(fn):
        loc = [t.detach().requires_grad_() for t in x]
        fn(loc)                                     # compile, autotune
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(loc)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def single(loc):
        o, _ = fn_single(*loc, backend="triton")
        torch.autograd.grad(o, loc, torch.ones_like(o))

    for sp in ("allgather", "ring"):
        def cp(loc, sp=sp):
            o, _ = fn_cp(*loc, backend="triton", state_passing=sp, plan=plan)
            torch.autograd.grad(o, loc, torch.ones_like(o))
        got, want = peak(cp), peak(single)
        assert got <= 1.25 * want, f"{op} rank {rank} {sp}: context-parallel fwd+bwd peak {got / 2**20:.1f} MiB, " \
                                   f"the operator on the shard {want / 2**20:.1f} MiB"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_diag_memory_two_gpus():
    """Peak memory per GPU of a context-parallel fwd+bwd of the diagonal operator at T_local = 16384 (H = 16,
    D = 128, bf16) is at most 1.25 x the single-GPU operator's at T_local."""
    run_ranks(2, _memory_body, "diag", backend="nccl", timeout=600, start="spawn")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_kda_memory_two_gpus():
    """The same for KDA (H = HV = 16, K = V = 128, bf16): rank 1 carries every row (u kept for the backward,
    the transition's tensors folded into the saved ones and freed in the forward)."""
    run_ranks(2, _memory_body, "kda", backend="nccl", timeout=600, start="spawn")
