"""Run a test body on W CPU ranks (gloo), each in its own spawned process; failures reach pytest.

``run_ranks(world, fn, *args)`` starts W processes once; each initialises a gloo process group,
calls ``fn(rank, world, *args)`` (a module-level function) and reports its traceback, if any, to the
parent, which raises with every failing rank's traceback. One start per world size: put many seeded
cases inside ``fn``. Processes fork from a forkserver that has imported torch and delta_attn once
(a clean single-threaded parent, unlike the pytest worker), and leave by ``os._exit`` (torch's
interpreter teardown costs seconds per process).
"""
from __future__ import annotations

import os
import tempfile
import traceback

import torch.multiprocessing as mp


def _worker(rank, world, init_file, fn, args, errors, backend):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            fn(rank, world, *args)
            # no rank tears down while another still connects: gloo's new_group can return on one rank before
            # the others have connected to the new group (seen as "Connection closed by peer" on a loaded machine)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:                      # noqa: BLE001  (every failure goes back to the parent)
        errors.put((rank, traceback.format_exc()))
        os._exit(1)
    os._exit(0)


def run_ranks(world: int, fn, *args, timeout: float = 300.0, backend: str = "gloo", start: str = "forkserver") -> None:
    """``backend="nccl"``: rank r on GPU r; gloo ranks may share a GPU. Tests that use CUDA pass
    ``start="spawn"`` (no process forked from one that might have touched CUDA)."""
    ctx = mp.get_context(start)
    if start == "forkserver":
        # torch.distributed.tensor: torch.testing.assert_close imports it (seconds) once a process group exists
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "pytest",
                                    "delta_attn.distributed", "delta_attn.ops.kda.autograd",
                                    "delta_attn.ops.diag.autograd"])
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "pg_init")
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, fn, args, errors, backend), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        if failures or hung:
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures))
            codes = {r: p.exitcode for r, p in enumerate(procs)}
            raise AssertionError(f"distributed test failed (exit codes {codes}, hung ranks {hung}):\n{msg}")
        bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if bad:
            raise AssertionError(f"ranks exited with non-zero codes {bad}")


def saved_bytes(fn):
    """(bytes of the distinct storages autograd keeps for the backward of ``fn()``, inputs included; its
    result)."""
    import torch
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out
