"""KDA training forward+backward, ``da.kda(backend="triton")`` then ``torch.autograd.grad``, against cuDNN frontend's
native KDA (the form its backward takes: q, k pre-normalised, fp32 g and beta, THD views, cu_seqlens made outside the
timed call) in one process: bf16, H 16, K = V = 128, long-memory (logsigmoid(N(4, 1))) and strong (logsigmoid(N(0, 1)))
decays; ``triton.testing.do_bench`` medians. Prints | B x T | decays | ours ms | cuDNN-FE ms | cuDNN / ours |.

python benchmarks/experiments/kda_train_vs_cudnn.py [CHECKOUT] [--shapes 8x4096,64x1024] [--profile] [--unchecked]
CHECKOUT: a checkout whose ``src`` is imported instead of the installed delta-attn; ``--profile``: each kernel's GPU
time per step (torch.profiler, 10 steps) instead of the timings: ours (long decays; its kernels do not depend on them)
and cuDNN-FE's with each regime; ``--unchecked``: a second row
per shape and regime, ours without the g <= 0 value check (DELTA_ATTN_SKIP_VALUE_CHECKS=1), against the same
cuDNN-FE time."""
import argparse
import os
import sys
ap = argparse.ArgumentParser()
ap.add_argument("checkout", nargs="?")
ap.add_argument("--shapes", default="8x4096,64x1024,16x2048,2x16384,1x32768,1x131072")
ap.add_argument("--profile", action="store_true")
ap.add_argument("--unchecked", action="store_true")
args = ap.parse_args()
if args.checkout:
    sys.path.insert(0, args.checkout + "/src")
import torch  # noqa: E402
import triton  # noqa: E402
import delta_attn as da  # noqa: E402
from cudnn.linear_attention import kimi_delta_attention  # noqa: E402
H, D = 16, 128


def times(B: int, T: int, mean: float, profile: str = "", peer: bool = True):
    """(ours ms, cuDNN-FE ms or None without ``peer``) of one forward+backward; with ``profile`` ("ours" or "peer")
    that implementation's per-kernel table instead."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k = (torch.nn.functional.normalize(r(B, T, H, D), dim=-1).bfloat16().requires_grad_() for _ in range(2))
    v = r(B, T, H, D).bfloat16().requires_grad_()
    g = torch.nn.functional.logsigmoid(r(B, T, H, D) + mean).float().requires_grad_()
    beta = torch.rand(B, T, H, device="cuda", generator=gen).float().requires_grad_()
    do = r(B, T, H, D).bfloat16()

    def ours():
        o = da.kda(q, k, v, g, beta, backend="triton")[0]
        torch.autograd.grad(o, (q, k, v, g, beta), do)

    cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * T
    qt, kt, vt = (x.detach().reshape(B * T, H, D).requires_grad_() for x in (q, k, v))
    gt = g.detach().reshape(B * T, H, D).requires_grad_()
    bt = beta.detach().reshape(B * T, H).requires_grad_()
    dot = do.reshape(B * T, H, D)

    def cudnn():
        o = kimi_delta_attention(qt, kt, vt, gt, bt, cu, use_qk_l2norm_in_kernel=False)
        o = o[0] if isinstance(o, (tuple, list)) else o
        torch.autograd.grad(o, (qt, kt, vt, gt, bt), dot)

    if profile:
        from torch.profiler import ProfilerActivity
        step = ours if profile == "ours" else cudnn
        step()
        with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        print(f"## {profile} {B} x {T} (g ~ logsigmoid(N({mean:g}, 1))): GPU time of 10 steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50))
        return None
    return (triton.testing.do_bench(ours, warmup=10, rep=100, return_mode="median"),
            triton.testing.do_bench(cudnn, warmup=10, rep=100, return_mode="median") if peer else None)


for B, T in [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]:
    if args.profile:
        times(B, T, 4.0, profile="ours")
        times(B, T, 4.0, profile="peer")
        times(B, T, 0.0, profile="peer")
        continue
    for regime, mean in (("long", 4.0), ("strong", 0.0)):
        t_o, t_c = times(B, T, mean)
        print(f"| {B} x {T} | {regime} | {t_o:.3f} | {t_c:.3f} | {t_c / t_o:.2f} |", flush=True)
        if args.unchecked:
            os.environ["DELTA_ATTN_SKIP_VALUE_CHECKS"] = "1"
            t_u = times(B, T, mean, peer=False)[0]
            os.environ["DELTA_ATTN_SKIP_VALUE_CHECKS"] = ""
            print(f"| {B} x {T} | {regime}, unchecked | {t_u:.3f} | {t_c:.3f} | {t_c / t_u:.2f} |", flush=True)
        torch.cuda.empty_cache()
