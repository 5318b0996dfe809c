"""``delta-attn bench scaling``: context parallelism (``delta_attn.distributed``) on N GPUs.

Run under ``torchrun --nproc-per-node N -m delta_attn.cli bench scaling --out DIR`` (N = 1 runs
without torchrun too). Every rank runs the same rows in lockstep; rank 0 writes the report.

- weak scaling: tokens per GPU fixed (``T_local``), N x T_local in all;
- strong scaling: ``--tokens`` in all (default 1M), T_total / N per GPU.

Per row: the context-parallel call (``dd.kda`` / ``dd.gated_diag_attn`` with each state-passing scheme,
``dd.flash_attn_func`` causal zigzag; each given the batch's ``dd.prepare`` plan, built once per row as a
training step builds it once per batch), the single-GPU operator on one rank's shard (``local_ms``: the
compute alone) and on the whole sequence (strong: ``one_gpu_ms``), and the collectives alone
(``comm_ms``: the linear ops' summary exchange, attention's all-gather of K and V, each with its
backward for fwd+bwd rows). Efficiency = N-GPU throughput / (N x one-GPU throughput), the one-GPU
throughput being the single-GPU operator on T_local tokens (weak) or on all of them (strong). Times are
the timer's protocol (bench/timer.py) with the repeat count agreed by all ranks; a row's time is the
slowest rank's median. A correctness probe (sharded result vs float64 reference, the error rule of docs/TESTING.md) runs
before a row is timed.

``efficiency_vs_ideal`` = ``ideal_ms / ms``, the ideal being one GPU's time on all the work divided by N:
``t1(T_total) / N``. Linear operators do work linear in the tokens, so for them it equals the efficiency
(weak: ``t1(N T_local) = N t1(T_local)``). Causal attention does work quadratic in the tokens: under weak
scaling N GPUs get N^2 times the work of one, and the plain efficiency (against N x one GPU at T_local)
understates them by N. Its ideal is ``t1(T_total)`` measured on one GPU when that fits (strong rows always;
weak rows: the single-GPU operator at T_total, skipped on out-of-memory), else the model
``t1(T_local) N^2``; ``ideal_source`` says which ("measured" / "model N^2" / "linear").

Memory (CUDA only): ``peak_mib``, the peak of the allocator over one context-parallel call (fwd, or fwd+bwd
with the gradients) above what was allocated before it, and ``local_peak_mib``, the same for the single-GPU
operator on the shard (T_local tokens); ``mem_ratio`` = their ratio (each the largest over the ranks).
"""
from __future__ import annotations

import os
import sys
import time
from datetime import datetime, timezone
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import settings
from .rows import ScalingRow
from .runner import DTYPES, Settings
from .text import number, percent, table
from .timer import estimate_ms, measure

OPS = ("kda", "diag", "flash")
WEAK_TOKENS_PER_GPU = 32768
STRONG_TOKENS = 1 << 20


def ensure_process_group(device: str) -> None:
    """Use the process group set up by the caller or torchrun (env://); without torchrun, one rank."""
    if dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if settings.launched_by_torchrun():                  # its rendezvous variables (env://)
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _device(s: Settings) -> torch.device:
    if s.device == "cuda":
        idx = dist.get_rank() % torch.cuda.device_count()
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def cases(s: Settings, world: int) -> List[Dict]:
    """(op, mode, T_local, T_total, H, D) of every row; tiny: toy sizes for the CPU test."""
    h, d = (2, 16) if s.tiny else (s.heads, s.head_dim)
    weak = 16 if s.tiny else WEAK_TOKENS_PER_GPU
    total = 48 if s.tiny else s.tokens
    out = []
    for op in OPS:
        if s.impls and not any(x.lower() in op for x in s.impls):
            continue
        out.append(dict(op=op, mode="weak", T_local=weak, T_total=weak * world, H=h, D=d))
        if total % (2 * world) == 0:
            out.append(dict(op=op, mode="strong", T_local=total // world, T_total=total, H=h, D=d))
        else:
            out.append(dict(op=op, mode="strong", T_local=None, T_total=total, H=h, D=d,
                            skip=f"{total} tokens do not divide into 2 x {world} equal chunks"))
    return out


def _inputs(op: str, t: int, h: int, d: int, dt, device, seed: int):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    rnd = lambda *sh: torch.randn(*sh, generator=gen, device=device, dtype=torch.float32).to(dt)  # noqa: E731
    q, k, v = rnd(1, t, h, d), rnd(1, t, h, d), rnd(1, t, h, d)
    if op == "flash":
        return [q, k, v]
    g = torch.nn.functional.logsigmoid(rnd(1, t, h, d).float() + 4.0).to(dt)
    if op == "diag":
        return [q, k, v, g]
    beta = torch.sigmoid(rnd(1, t, h).float()).to(dt)
    return [q, k, v, g, beta]


def _calls(op: str, state_passing: Optional[str], device: torch.device):
    """(single-GPU call, context-parallel call, layout) of ``op``; the context-parallel call takes the batch's
    plan as its keyword ``plan``. GPU: backend "auto"; CPU (the tiny check that the suite runs): the "torch"
    reference path, as the Triton interpreter would take minutes."""
    import delta_attn as da
    import delta_attn.distributed as dd
    kw = {"backend": "auto" if device.type == "cuda" else "torch"}
    if op == "kda":
        return (lambda *x: da.kda(*x, use_qk_l2norm=True, **kw)[0],
                lambda *x, plan=None: dd.kda(*x, use_qk_l2norm=True, state_passing=state_passing, plan=plan,
                                             **kw)[0], "contiguous")
    if op == "diag":
        return (lambda *x: da.gated_diag_attn(*x, **kw)[0],
                lambda *x, plan=None: dd.gated_diag_attn(*x, state_passing=state_passing, plan=plan, **kw)[0],
                "contiguous")
    if not hasattr(dd, "flash_attn_func"):
        return None
    return (lambda *x: da.flash_attn_func(*x, causal=True, **kw),
            lambda *x, plan=None: dd.flash_attn_func(*x, causal=True, layout="zigzag", plan=plan, **kw), "zigzag")


def _agree_max(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _direction(fn: Callable[[], object], direction: str, leaves) -> Callable[[], object]:
    """``fn`` for "fwd"; for "fwd+bwd", ``fn`` then its backward with the leaves' gradients cleared."""
    if direction == "fwd":
        return fn

    def call():
        out = fn()
        out.backward(torch.ones_like(out))
        for x in leaves:
            x.grad = None
    return call


def _timed(fn: Callable[[], object], s: Settings, device, direction: str, leaves) -> Dict:
    """Time ``fn`` (fwd) or its forward + backward on every rank with one repeat count; the slowest
    rank's median. Every rank must call this with the same function shapes (collectives inside)."""
    call = _direction(fn, direction, leaves)
    call()                                                      # first call: compile, autotune
    est = _agree_max(estimate_ms(call, device), device)
    warm = 0 if s.warmup_ms <= 0 else min(50, int(s.warmup_ms / max(est, 1e-3)))
    reps = max(s.min_reps, min(s.max_reps, int(s.rep_ms / max(est, 1e-3))))
    for _ in range(warm):
        call()
    dist.barrier()
    t = measure(call, device, warmup_ms=0.0, rep_ms=0.0, min_reps=reps, max_reps=reps, estimate=est)
    return {"ms": _agree_max(t.median_ms, device), "ms_min": _agree_max(t.min_ms, device), "reps": reps}


def _timed_local(fn, s: Settings, device, direction: str, leaves) -> Dict:
    """A single-GPU call timed on every rank at once (no collectives inside); the slowest median."""
    call = _direction(fn, direction, leaves)
    call()
    est = estimate_ms(call, device)
    t = measure(call, device, warmup_ms=s.warmup_ms, rep_ms=s.rep_ms, min_reps=s.min_reps, max_reps=s.max_reps,
                estimate=est)
    dist.barrier()
    return {"ms": _agree_max(t.median_ms, device)}


def _comm_call(op: str, state_passing: Optional[str], x_local: List[torch.Tensor], device, direction: str):
    """The op's collectives alone, on tensors of the sizes the call exchanges: ``(call, leaves, direction to
    time it as)``. Linear operators: the summary exchange (and its reverse for fwd+bwd) with the tables of a
    dense batch; attention: the all-gather of K and V (and the reduce-scatter of their gradients)."""
    from ..distributed import _carry, _comm
    from ..distributed.plan import _dense_linear
    b, t, h, d = x_local[0].shape
    if op == "flash":                       # all-gather of the K and V shards (reduce-scatter of dK, dV)
        kv = torch.stack([x_local[1], x_local[2]]).detach().requires_grad_()
        return (lambda: _comm.all_gather(kv)), [kv], direction
    rank, world = dist.get_rank(), dist.get_world_size()
    lp = _dense_linear(rank, world, t)
    shape = (b, h, d, d) if op == "kda" else (b, h, d)
    m = torch.zeros((b, h, d, d) if op == "kda" else shape, device=device)
    s = torch.zeros(shape, device=device)
    aff = _carry.Affine(matrix=op == "kda")

    def call():
        c, ms = _carry.carry(lp, aff, m, s, state_passing, None)
        if direction != "fwd":
            _carry.carry_grad(lp, aff, m, ms, c if lp.cont[rank] else None, s, state_passing, None)
    return call, [], "fwd"


def _local_peak_bytes(call: Callable[[], object], device) -> Optional[int]:
    """Run ``call()``; on CUDA, the allocator's peak over it above what was allocated before it (bytes, this rank);
    None off CUDA."""
    if device.type != "cuda":
        call()
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _peak_mib(call: Callable[[], object], device) -> Optional[float]:
    """The allocator's peak over one ``call()`` above what was allocated before it (MiB; the largest over the
    ranks); None off CUDA."""
    if device.type != "cuda":
        return None
    return _agree_max(_local_peak_bytes(call, device) / 2 ** 20, device)


# the context-parallel call's peak memory over the single-GPU operator's on the shard, with headroom (4 x H100:
# 1.4x for KDA weak fwd+bwd, 1.7x for KDA strong fwd)
CP_MEMORY_FACTOR = 2.0


def _fits_on_every_rank(call: Callable[[], object], device) -> bool:
    """Whether the row fits on every rank. Each rank runs the single-GPU operator on its shard once (no
    collective inside, so a rank that runs out of memory cannot leave the others waiting in one) and, on CUDA,
    checks that CP_MEMORY_FACTOR times that peak fits its free memory; one all-reduce then makes the ranks
    agree, so a row runs on every rank or on none."""
    ok = 1.0
    try:
        peak = _local_peak_bytes(call, device)
        if peak is not None:
            ok = float(CP_MEMORY_FACTOR * peak <= torch.cuda.mem_get_info(device)[0])
    except torch.cuda.OutOfMemoryError:
        ok = 0.0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return -_agree_max(-ok, device) > 0.5


def _probe(op: str, state_passing, dt, device, s: Settings) -> Optional[str]:
    """Sharded result against the float64 reference on a small shape (docs/TESTING.md's rule); the failure or None."""
    import delta_attn.distributed as dd
    from .. import reference
    from ..testing import check
    world = dist.get_world_size()
    calls = _calls(op, state_passing, device)
    x = _inputs(op, 8 * world if s.tiny else 64 * world, 2, 16, dt, device, s.seed + 1)
    layout = calls[2]
    got = dd.unshard(calls[1](*(dd.shard(t, layout=layout) for t in x)).detach(), layout=layout)
    if op == "kda":
        f = lambda L, up: reference.kda(*L, use_qk_l2norm=True, upcast=up)[0]     # noqa: E731
    elif op == "diag":
        f = lambda L, up: reference.gated_diag(*L, upcast=up)[0]                  # noqa: E731
    else:
        f = lambda L, up: reference.attention(*L, causal=True, upcast=up)[0]      # noqa: E731
    v = check(got, f([t.double() for t in x], True), f(x, False), name=op)
    return None if v.ok else v.message


def run_scaling(s: Settings, out_dir: str, command: Optional[str] = None) -> Optional[str]:
    """Run the scaling rows on every rank of the default group; rank 0 writes results.jsonl and
    report.md in ``out_dir`` and returns the report's path (other ranks: None)."""
    from .. import env as _env
    from . import results_files

    s.check()
    ensure_process_group(s.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(s)
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    rows: List[ScalingRow] = []
    for dname in s.dtypes:
        dt = DTYPES[dname]
        for c in cases(s, world):
            schemes = ("allgather", "ring") if c["op"] != "flash" else (None,)
            for sp in schemes:
                for direction in (s.directions or ("fwd", "fwd+bwd")):
                    measured = dict(status="ok", note="")
                    measured.update(_measure_row(c, sp, dt, direction, device, s, world))
                    row = ScalingRow(suite="scaling", op=c["op"], mode=c["mode"], world=world, state_passing=sp,
                                     dtype=dname, direction=direction, tokens_total=c["T_total"],
                                     tokens_per_gpu=c["T_local"], H=c["H"], D=c["D"], **measured)
                    rows.append(row)
                    if rank == 0:
                        print(f"[scaling] {row.op} {row.mode} N={world} {sp or ''} {direction}: "
                              f"{row.status} {number(row.ms)} ms eff {percent(row.efficiency)}"
                              + (f" ({row.note})" if row.note else ""), file=sys.stderr, flush=True)
    if rank != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    run = {"suite": "scaling", "command": command or " ".join(["delta-attn"] + sys.argv[1:]), "world_size": world,
           "backend": dist.get_backend(), "started": started.strftime("%Y-%m-%d %H:%M:%S"),
           "duration_s": time.perf_counter() - t0, "tiny": s.tiny, "settings": s.as_dict(), "env": _env.collect()}
    records = [r.to_json() for r in rows]
    results_files.write_jsonl(os.path.join(out_dir, "results.jsonl"), run, records)
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write(markdown(run, records))
    return path


def _whole_ms(single, c: Dict, dt, device, s: Settings, direction: str, grad: bool) -> float:
    """The single-GPU operator on all T_total tokens (every rank runs it on its own GPU: the slowest)."""
    whole = [x.detach().clone().requires_grad_(grad) for x in
             _inputs(c["op"], c["T_total"], c["H"], c["D"], dt, device, s.seed)]
    return _timed_local(lambda: single(*whole), s, device, direction, whole)["ms"]


def _ideal(c: Dict, out: Dict, world: int, single, dt, device, s: Settings, direction: str, grad: bool) -> Dict:
    """``ideal_ms`` = one GPU's time on all the work / N, and where that time comes from (module docstring)."""
    if c["mode"] == "strong" or world == 1:
        return {"ideal_ms": out["one_gpu_ms"] / world, "ideal_source": "measured"}
    if c["op"] != "flash":
        return {"ideal_ms": out["local_ms"], "ideal_source": "linear"}
    try:
        return {"ideal_ms": _whole_ms(single, c, dt, device, s, direction, grad) / world, "ideal_source": "measured"}
    except torch.cuda.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"ideal_ms": out["local_ms"] * world, "ideal_source": "model N^2"}


def _measure_row(c: Dict, sp, dt, direction: str, device, s: Settings, world: int) -> Dict:
    """The measured fields of one row's :class:`ScalingRow` (status and note when it did not run)."""
    import delta_attn.distributed as dd
    if c.get("skip"):
        return {"status": "skipped", "note": c["skip"]}
    if direction not in ("fwd", "fwd+bwd"):
        return {"status": "skipped", "note": "the scaling suite times fwd and fwd+bwd"}
    calls = _calls(c["op"], sp, device)
    if calls is None:
        return {"status": "unavailable", "note": "delta_attn.distributed.flash_attn_func is not in this install"}
    single, parallel, layout = calls
    try:
        bad = _probe(c["op"], sp, dt, device, s)
        if bad:
            return {"status": "FAILED", "note": "correctness probe: " + bad}
        grad = direction != "fwd"
        full = _inputs(c["op"], c["T_total"], c["H"], c["D"], dt, device, s.seed)
        local = [dd.shard(x, layout=layout).detach().clone().requires_grad_(grad) for x in full]
        del full
        out = {}
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx:
            fits = _fits_on_every_rank(_direction(lambda: single(*local), direction, local), device)
        if not fits:
            return {"status": "skipped", "note": f"out of memory: the single-GPU operator on a shard, times "
                                                 f"{CP_MEMORY_FACTOR:g} for the context-parallel call, does not fit "
                                                 f"on every rank"}
        plan = dd.prepare(seqlen=c["T_total"], layout=layout, device=device)     # once per batch
        with ctx:
            out.update(_timed(lambda: parallel(*local, plan=plan), s, device, direction, local))
            out["local_ms"] = _timed_local(lambda: single(*local), s, device, direction, local)["ms"]
            out["peak_mib"] = _peak_mib(_direction(lambda: parallel(*local, plan=plan), direction, local), device)
            out["local_peak_mib"] = _peak_mib(_direction(lambda: single(*local), direction, local), device)
            comm, leaves, comm_dir = _comm_call(c["op"], sp, local, device, direction)
            out["comm_ms"] = _timed(comm, s, device, comm_dir, leaves)["ms"]
            if c["mode"] == "strong" and world > 1:
                out["one_gpu_ms"] = _whole_ms(single, c, dt, device, s, direction, grad)
            else:                           # weak, or one rank: the shard is what one GPU runs
                out["one_gpu_ms"] = out["local_ms"]
            out.update(_ideal(c, out, world, single, dt, device, s, direction, grad))
        if out["peak_mib"] is not None and out["local_peak_mib"]:
            out["mem_ratio"] = out["peak_mib"] / out["local_peak_mib"]
        one_gpu_tokens = c["T_local"] if c["mode"] == "weak" else c["T_total"]
        out["tokens_per_s"] = c["T_total"] / (out["ms"] / 1e3)
        out["one_gpu_tokens_per_s"] = one_gpu_tokens / (out["one_gpu_ms"] / 1e3)
        out["efficiency"] = out["tokens_per_s"] / (world * out["one_gpu_tokens_per_s"])
        out["efficiency_vs_ideal"] = out["ideal_ms"] / out["ms"]
        return out
    except torch.cuda.OutOfMemoryError:
        return {"status": "skipped", "note": "out of memory"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def markdown(run: Dict, rows: List[Dict]) -> str:
    from .report import env_block
    lines = [f"# delta-attn bench scaling: {run['world_size']} rank(s), {run['backend']}", "",
             f"Command: `{run['command']}`  ", f"Started {run['started']} UTC, {run['duration_s']:.0f} s.", "",
             "Efficiency = N-GPU tokens/s / (N x one-GPU tokens/s); one GPU runs the single-GPU operator on "
             "T_local tokens (weak) or on all of them (strong). `vs ideal` = ideal ms / ms, the ideal being one "
             "GPU's time on all the work / N (`measured` at T_total, or the causal `model N^2` from T_local; "
             "`linear` = the efficiency). `local` = the single-GPU operator on one shard (the compute alone), "
             "`comm` = the op's collectives alone. Memory: the allocator's peak over one call above what was "
             "allocated before it, context-parallel vs the single-GPU operator on the shard (MiB, largest rank). "
             "Times: slowest rank's median.", ""]
    head = ["op", "mode", "exchange", "dtype", "dir", "tokens (per GPU)", "ms", "local ms", "comm ms",
            "one-GPU ms", "tokens/s", "efficiency", "ideal ms", "vs ideal", "peak MiB (local)", "status"]
    body = []
    for r in rows:
        exch = r["state_passing"] or "K/V all-gather (zigzag)"
        per = f"{r['tokens_total']:,} ({r['tokens_per_gpu']:,})" if r["tokens_per_gpu"] else f"{r['tokens_total']:,}"
        body.append([r["op"], r["mode"], exch, r["dtype"], r["direction"], per, number(r.get("ms")),
                     number(r.get("local_ms")), number(r.get("comm_ms")), number(r.get("one_gpu_ms")),
                     number(r.get("tokens_per_s")), percent(r.get("efficiency")),
                     number(r.get("ideal_ms")) + (f" ({r['ideal_source']})" if r.get("ideal_source") else ""),
                     percent(r.get("efficiency_vs_ideal")),
                     f"{number(r.get('peak_mib'))} ({number(r.get('local_peak_mib'))})" if r.get("peak_mib") is not None
                     else "",
                     r["status"] + (f": {r['note']}" if r["note"] else "")])
    lines += [table(head, body), "", "## Environment", "", env_block(run), ""]
    return "\n".join(lines)
