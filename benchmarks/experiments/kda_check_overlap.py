"""Can the g <= 0 check's reduction run beside the fused KDA forward where the kernel fills every SM (64x1024:
1,024 programs, two per SM)? Two programs of 255 registers take 65,280 of an SM's 65,536, so no block of the
reduction fits beside them and it waits for programs to end (0.18 ms at 64x1024 on an H100). Here the fused kernel
is compiled with a register cap (``maxnreg``) that leaves room for one small reduction block per SM, and the
reduction is either torch's ``amax`` (as shipped) or a low-footprint Triton max (4 warps, a few registers, one
program per SM, NaN read as 0 as the check's second pass does), on a high-priority side stream whose result is
copied to pinned memory and waited for, as ``_checks._start_max_read`` does.

python benchmarks/experiments/kda_check_overlap.py [--shapes 64x1024,16x2048,8x4096] [--caps 0,240,232]
Prints | B x T | cap | reduction | ms | cuDNN-FE ms | cuDNN / ours | (cap 0: no cap; reduction none: unchecked).
bf16, H = 16, K = V = 128, long-memory decays, q / k L2-normed in the kernel; ``triton.testing.do_bench`` medians.
"""
import argparse
import functools

import torch
import triton
import triton.language as tl

from delta_attn.ops.kda import launch

H, D = 16, 128


@triton.jit
def _small_max_kernel(x, out, n, per_program, BLOCK: tl.constexpr):
    """max over x[pid * per_program : (pid + 1) * per_program] (NaN read as 0), atomically into out."""
    start = tl.program_id(0).to(tl.int64) * per_program
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for i in range(0, per_program, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        v = tl.load(x + offs, mask=(offs < n) & (i + tl.arange(0, BLOCK) < per_program), other=float("-inf"))
        v = v.to(tl.float32)
        top = tl.maximum(top, tl.where(v != v, 0.0, v))
    tl.atomic_max(out, tl.max(top, 0))


class Capped:
    """``launch._kda_fused_fwd_kernel`` launched with a register cap."""

    def __init__(self, kernel, cap):
        self.kernel, self.cap = kernel, cap

    def __getitem__(self, grid):
        run = self.kernel[grid]
        return lambda *a, **kw: run(*a, maxnreg=self.cap, **kw)


def small_max(g, top, programs, per_program):
    top.fill_(float("-inf"))
    _small_max_kernel[(programs,)](g, top, g.numel(), per_program, BLOCK=2048, num_warps=4)
    return top


def checked_forward(inputs, reduce, side, host):
    """The fused forward, with ``reduce`` (None: no check) on the side stream and its host copy waited for after
    the launch, as the shipped check does."""
    if reduce is not None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(reduce(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
    o = launch.fused_forward(*inputs, None, None, D ** -0.5, True, False)[0]
    if reduce is not None:
        done.synchronize()
        assert host.item() <= 0
    return o


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x1024,16x2048,8x4096")
    ap.add_argument("--caps", default="0,240,232")
    args = ap.parse_args()
    from cudnn.linear_attention import kimi_delta_attention
    side = torch.cuda.Stream(priority=-1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    host = torch.empty((), dtype=torch.float32, pin_memory=True)
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
        top = torch.empty((), dtype=torch.float32, device="cuda")
        per = triton.cdiv(triton.cdiv(g.numel(), sms), 2048) * 2048
        reductions = {"none": None, "torch amax": g.amax,
                      "small max": functools.partial(small_max, g, top, sms, per)}
        for cap in map(int, args.caps.split(",")):
            launch._kda_fused_fwd_kernel = Capped(kernel, cap) if cap else kernel
            for name, reduce in reductions.items():
                call = functools.partial(checked_forward, (q, k, v, g, beta), reduce, side, host)
                with torch.no_grad():
                    t = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
                print(f"| {B} x {T} | {cap or '-'} | {name} | {t:.3f} | {t_c:.3f} | {t_c / t:.2f} |", flush=True)
        launch._kda_fused_fwd_kernel = kernel
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
