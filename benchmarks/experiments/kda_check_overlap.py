"""Can the g <= 0 check's reduction run beside the fused KDA forward where the kernel fills every SM (64x1024:
1,024 programs, two per SM)? Two programs of 255 registers take 65,280 of an SM's 65,536, so no block of the
reduction fits beside them and it waits for programs to end (0.18 ms at 64x1024 on an H100). Here the fused kernel
is compiled with a register cap (``maxnreg``) that leaves room for one small reduction block per SM, and the
reduction is either torch's ``amax`` (as shipped; 512-thread blocks) or a low-footprint Gluon max (4 warps, about
20 registers, its loads in flight through a cp.async ring in shared memory, one program per SM writing its
maximum of max(0, g), NaN read as 0 as the check's second pass does: enough for the verdict), on a high-priority
side stream whose result is copied to pinned memory (the per-program maxima by the copy engine, no SM needed)
and waited for, as ``_checks._start_max_read`` does.

python benchmarks/experiments/kda_check_overlap.py [--shapes 64x1024,16x2048,8x4096] [--caps 0,240,232]
Prints | B x T | cap | reduction | ms | cuDNN-FE ms | cuDNN / ours | (cap 0: no cap; reduction none: unchecked).
bf16, H = 16, K = V = 128, long-memory decays, q / k L2-normed in the kernel; ``triton.testing.do_bench`` medians.
"""
import argparse
import functools

import torch
import triton
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from delta_attn.ops._gluon import gl, gluon
from delta_attn.ops.kda import launch

H, D = 16, 128


@gluon.jit
def _small_max_kernel(x, partial, n, per_program, BLOCK: gl.constexpr, STAGES: gl.constexpr):
    """max(0, x[pid * per_program : (pid + 1) * per_program]) (NaN read as 0) into partial[pid]; n and
    per_program multiples of 16 (the launch specialises on it: whole 16-byte copies). cp.async of BLOCK values per
    stage into a ring of STAGES, STAGES - 1 in flight (the loads wait in shared memory, not in registers), each
    stage read back by the threads that copied it."""
    L: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    ring = gl.allocate_shared_memory(x.dtype.element_ty, [STAGES, BLOCK], SH)
    start = gl.program_id(0).to(gl.int64) * per_program
    idx = gl.arange(0, BLOCK, layout=L)
    for s in gl.static_range(STAGES - 1):
        offs = start + s * BLOCK + idx
        async_copy.async_copy_global_to_shared(ring.index(s), x + offs, mask=(offs < n) & (offs < start + per_program))
        async_copy.commit_group()
    top = gl.zeros([BLOCK], gl.float32, L)
    for i in range(0, (per_program // BLOCK).to(gl.int32)):
        gl.thread_barrier()                         # the stage read last iteration is free
        offs = start + (i + STAGES - 1) * BLOCK + idx
        async_copy.async_copy_global_to_shared(ring.index((i + STAGES - 1) % STAGES), x + offs,
                                               mask=(offs < n) & (offs < start + per_program))
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        v = ring.index(i % STAGES).load(L).to(gl.float32)
        top = gl.maximum(top, gl.where(v != v, 0.0, v))
    async_copy.wait_group(0)
    gl.store(partial + gl.program_id(0), gl.max(top, 0))


def small_max(g, partial, per_program, block=512, stages=16):
    """The per-program maxima of max(0, g) (``partial``: one per program), for a host copy and a max there."""
    _small_max_kernel[(partial.numel(),)](g, partial, g.numel(), per_program, BLOCK=block, STAGES=stages,
                                          num_warps=4)
    return partial


class Capped:
    """``launch._kda_fused_fwd_kernel`` launched with a register cap."""

    def __init__(self, kernel, cap):
        self.kernel, self.cap = kernel, cap

    def __getitem__(self, grid):
        run = self.kernel[grid]
        return lambda *a, **kw: run(*a, maxnreg=self.cap, **kw)


def checked_forward(inputs, reduce, side, hosts):
    """The fused forward, with ``reduce`` (None: no check) on the side stream and its host copy (one value, or the
    small max's per-program maxima) waited for after the launch, as the shipped check does."""
    if reduce is not None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            top = reduce()
            host = hosts[top.numel()]
            host.copy_(top.reshape(host.shape), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
    o = launch.fused_forward(*inputs, None, None, D ** -0.5, True, False)[0]
    if reduce is not None:
        done.synchronize()
        assert host.max().item() <= 0
    return o


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x1024,16x2048,8x4096")
    ap.add_argument("--caps", default="0,240,232")
    args = ap.parse_args()
    from cudnn.linear_attention import kimi_delta_attention
    side = torch.cuda.Stream(priority=-1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hosts = {1: torch.empty((), dtype=torch.float32, pin_memory=True),
             sms: torch.empty(sms, dtype=torch.float32, pin_memory=True)}
    kernel = launch._kda_fused_fwd_kernel
    for B, T in [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16() for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, device="cuda", generator=gen) + 4.0)
        beta = torch.rand(B, T, H, device="cuda", generator=gen)
        cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * T
        flat = [x.reshape(B * T, H, -1) for x in (q, k, v, g)] + [beta.reshape(B * T, H)]
        peer = functools.partial(kimi_delta_attention, *flat, cu, use_qk_l2norm_in_kernel=True)
        t_c = triton.testing.do_bench(peer, warmup=25, rep=200, return_mode="median")
        partial = torch.empty(sms, dtype=torch.float32, device="cuda")
        per = triton.cdiv(triton.cdiv(g.numel(), sms), 512) * 512
        reductions = {"none": None, "torch amax": g.amax,
                      "small max, 8 stages": functools.partial(small_max, g, partial, per, stages=8),
                      "small max, 16 stages": functools.partial(small_max, g, partial, per, stages=16)}
        for cap in map(int, args.caps.split(",")):
            launch._kda_fused_fwd_kernel = Capped(kernel, cap) if cap else kernel
            for name, reduce in reductions.items():
                call = functools.partial(checked_forward, (q, k, v, g, beta), reduce, side, hosts)
                with torch.no_grad():
                    t = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
                print(f"| {B} x {T} | {cap or '-'} | {name} | {t:.3f} | {t_c:.3f} | {t_c / t:.2f} |", flush=True)
        launch._kda_fused_fwd_kernel = kernel
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
