"""KDA context parallelism on W GPUs (torchrun), dense, weak scaling: dd.kda on T_local tokens per GPU against the
single-GPU operator on the same T_local, forward and forward+backward, plus the gathered output against one GPU's
whole sequence and the peak memory ratio of a forward+backward (bf16, H = 16, K = V = 128, long-memory decays,
in-kernel q/k L2 norm, backend="triton", calls given a plan).

torchrun --nproc-per-node 2 benchmarks/experiments/kda_cp_probe.py 32768
Prints per rank: the first context-parallel forward+backward's time (cold), the max relative difference of the
gathered output (rank 0), and fwd / fwd+bwd ms with efficiency = one-GPU ms / context-parallel ms.
"""
import faulthandler
import sys
import time

faulthandler.dump_traceback_later(150, exit=True)
import torch
import torch.distributed as dist
import triton

import delta_attn as da
import delta_attn.distributed as dd
dist.init_process_group("nccl")
r, W = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(r); dev = torch.device("cuda", r)
TL, H, D = int(sys.argv[1]), 16, 128
gen = torch.Generator(device=dev).manual_seed(0)
def full(*s): return torch.randn(*s, device=dev, generator=gen)
q, k, v = (full(1, W * TL, H, D).bfloat16() for _ in range(3))
g = torch.nn.functional.logsigmoid(full(1, W * TL, H, D) + 4.0)
beta = torch.rand(1, W * TL, H, device=dev, generator=gen)
do = full(1, W * TL, H, D).bfloat16()
sl = slice(r * TL, (r + 1) * TL)
loc = [t[:, sl].contiguous().requires_grad_() for t in (q, k, v, g, beta)]
plan = dd.prepare(seqlen=W * TL, device=dev)
def cp(grad):
    o, _ = dd.kda(*loc, use_qk_l2norm=True, plan=plan, backend="triton")
    if grad:
        torch.autograd.grad(o, loc, do[:, sl])
    return o
t = time.perf_counter(); o = cp(True); torch.cuda.synchronize(); first = time.perf_counter() - t
print(f"rank {r} first cp fwd+bwd {first:.1f}s", flush=True)
# correctness: the gathered output against one GPU's whole sequence
with torch.no_grad():
    o_cp = cp(False)
gathered = [torch.empty_like(o_cp) for _ in range(W)]
dist.all_gather(gathered, o_cp.contiguous())
if r == 0:
    with torch.no_grad():
        ref, _ = da.kda(q, k, v, g, beta, use_qk_l2norm=True, backend="triton")
    diff = (torch.cat(gathered, 1).float() - ref.float()).abs().max() / ref.float().abs().max()
    print(f"cp vs one GPU: max rel diff {diff:.2e}", flush=True)
def bench(fn):
    dist.barrier(); torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=60, return_mode="median")
single = [t.detach().requires_grad_() for t in loc]
def one(grad):
    o, _ = da.kda(*single, use_qk_l2norm=True, backend="triton")
    if grad:
        torch.autograd.grad(o, single, do[:, sl])
res = {}
for grad in (False, True):
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx:
        res[("cp", grad)] = bench(lambda: cp(grad))
        res[("one", grad)] = bench(lambda: one(grad))
    torch.cuda.reset_peak_memory_stats()
peak = {}
for name, fn in (("one", lambda: one(True)), ("cp", lambda: cp(True))):
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    fn(); torch.cuda.synchronize(); peak[name] = torch.cuda.max_memory_allocated() - base
print(f"rank {r} T_local {TL}: fwd cp {res[('cp', False)]:.3f} one {res[('one', False)]:.3f} eff {res[('one', False)] / res[('cp', False)]:.0%}; "
      f"fwd+bwd cp {res[('cp', True)]:.3f} one {res[('one', True)]:.3f} eff {res[('one', True)] / res[('cp', True)]:.0%}; "
      f"peak mem cp/one {peak['cp'] / peak['one']:.2f}", flush=True)
dist.destroy_process_group()
