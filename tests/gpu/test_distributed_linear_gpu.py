"""dd.kda / dd.gated_diag_attn on CUDA with backend="triton" (bf16, fp16) against the float64 reference
(the error rule of docs/TESTING.md; outputs, final states, every gradient):

- world size 1 over NCCL in this process (the path a single-GPU job with context parallelism takes);
- 2 and 3 ranks sharing the one GPU over gloo (gloo moves CUDA tensors through the host): the state
  passing proper (identity-block launch, carries, corrections) on the real kernels, all-gather scheme;
- 2+ ranks over NCCL, one GPU each, both schemes, when several GPUs are visible.
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
                                         ("kda", torch.bfloat16, 128, 256),     # V + K > 256: two launches
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
    import test_distributed_linear as L
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
        got = L._sharded(fn_dd, xs, kw, w, world, backend=backend, state_passing=c["scheme"])
        r64 = L._single(fn_ref, [x.double() for x in xs],
                        {k: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for k, t in kw.items()}, w)
        low = L._single(fn_ref, xs, kw, w, upcast=False)
        names = ["o", "final"] + L._names(kw, len(xs))
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
