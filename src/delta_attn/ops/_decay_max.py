"""The g <= 0 check's reduction on the GPU, small enough to run beside a kernel that fills every SM.

``_checks.PendingChecks`` enqueues the reduction of a log decay g on a side stream before the call's kernels and
waits for its host copy after them. torch's ``amax`` runs 512-thread blocks, which find no room on an SM that
already holds two programs of a 240-register kernel, so it waits for those programs to end. Here one program per
SM of four warps and about 30 registers (4,096 of the SM's 65,536 registers: what two 240-register warpgroups
leave) reads its share of g through a ring of cp.async stages in shared memory, so the loads in flight cost no
registers; each program writes max(0, its share) with NaN read as 0 (what the verdict needs: g > 0 anywhere), and
the per-program maxima reach the host by the copy engine, with no SM.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..backends import device_capability
from . import _gluon
from ._gluon import gl, gluon

BLOCK = 512      # values per stage (four per thread: 16-byte copies of fp32, 8-byte of 16-bit values)
STAGES = 8       # stages in the ring, 7 in flight: 16 KB of fp32, which fits beside two programs of the training
                 # intra-chunk kernel (100 KB each) in an SM's 228 KB
WARPS = 4

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    @gluon.jit
    def _positive_max_kernel(x, partial, n, per_program, BLOCK: gl.constexpr, STAGES: gl.constexpr):
        """partial[pid] = max(0, x[pid * per_program : (pid + 1) * per_program]), NaN read as 0; n and per_program
        multiples of 16 (whole copies). Each stage is read back by the threads that copied it."""
        L: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        ring = gl.allocate_shared_memory(x.dtype.element_ty, [STAGES, BLOCK], SH)
        start = gl.program_id(0).to(gl.int64) * per_program
        idx = gl.arange(0, BLOCK, layout=L)
        for s in gl.static_range(STAGES - 1):
            offs = start + s * BLOCK + idx
            async_copy.async_copy_global_to_shared(ring.index(s), x + offs,
                                                   mask=(offs < n) & (offs < start + per_program))
            async_copy.commit_group()
        top = gl.zeros([BLOCK], gl.float32, L)
        for i in range(0, (per_program // BLOCK).to(gl.int32)):
            gl.thread_barrier()                     # the stage read last iteration is free
            offs = start + (i + STAGES - 1) * BLOCK + idx
            async_copy.async_copy_global_to_shared(ring.index((i + STAGES - 1) % STAGES), x + offs,
                                                   mask=(offs < n) & (offs < start + per_program))
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)
            v = ring.index(i % STAGES).load(L).to(gl.float32)
            top = gl.maximum(top, gl.where(v != v, 0.0, v))
        async_copy.wait_group(0)
        gl.store(partial + gl.program_id(0), gl.max(top, 0))
else:
    _positive_max_kernel = None


def runs(x: torch.Tensor) -> bool:
    """Whether :func:`start_positive_max` reads ``x`` with the small kernel: a contiguous float tensor of a multiple
    of 16 values on a CUDA GPU of sm_80 or later (cp.async) with the Gluon release the kernels are written for."""
    return (_positive_max_kernel is not None and _gluon.kernels_release(x.device) and x.is_contiguous()
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.numel() % 16 == 0
            and device_capability(x.device) >= (8, 0))


def start_positive_max(x: torch.Tensor, stream: "torch.cuda.Stream") -> Optional[Callable[[], float]]:
    """Where :func:`runs` (else None): enqueues on ``stream`` (which the caller has made wait for x's producers) the
    per-program maxima of max(0, x) (NaN read as 0) and their copy to pinned memory, and returns the function that
    waits for that copy alone and gives their maximum. The caller keeps x alive until it has called the function."""
    if not runs(x):
        return None
    programs = torch.cuda.get_device_properties(x.device).multi_processor_count     # one program per SM
    per_program = -(-x.numel() // (programs * BLOCK)) * BLOCK
    with torch.cuda.stream(stream):
        partial = torch.empty(programs, dtype=torch.float32, device=x.device)
        _positive_max_kernel[(programs,)](x, partial, x.numel(), per_program, BLOCK=BLOCK, STAGES=STAGES,
                                          num_warps=WARPS)
    return read_max(partial, stream)


def read_max(partial: torch.Tensor, stream: Optional["torch.cuda.Stream"] = None) -> Callable[[], float]:
    """Enqueues on ``stream`` (default: the current one) the copy of ``partial`` (float32 per-program maxima on the
    GPU) to pinned memory and returns the function that waits for that copy alone and gives their maximum (on the
    CPU: their maximum, read now)."""
    if partial.device.type != "cuda":
        top = float(partial.max())
        return lambda: top
    stream = stream if stream is not None else torch.cuda.current_stream(partial.device)
    with torch.cuda.stream(stream):
        host = torch.empty(partial.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(partial, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return lambda: (done.synchronize(), float(host.max()))[1]
