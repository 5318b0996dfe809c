"""What a g <= 0 check read after the fused forward's kernel (a maximum the kernel writes, the host waiting for it)
would cost, against the shipped check (g reduced beside the kernel) and no check (bf16, H = 16, K = V = 128, long
decays, q/k L2-normed in the kernel; ``do_bench`` medians with the L2 flushed, as kda_prefill.py).

python benchmarks/experiments/kda_check_lockstep.py [--shapes 64x1024,16x2048,8x4096]
Columns (ms unless named): ``checked`` (da.kda as shipped); ``unchecked`` (no value check); ``unchecked_sync`` (the
host waits for the call's kernels before returning); ``graph`` (the unchecked call replayed from a CUDA graph: the
GPU's time with almost no host work); ``graph_sync`` (the replay, then the host waits: the least a check read after
the kernel can cost under this timer); ``cudnn`` (cuDNN-FE native); ``host_us`` (the host's time in us to issue one
unchecked call, the GPU kept busy).
"""
import argparse
import time

import torch
import triton

import delta_attn as da
from delta_attn import _checks

from kda_prefill import bench, cudnn_fn, inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x1024,16x2048,8x4096")
    args = ap.parse_args()
    print("#", torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for shape in args.shapes.split(","):
        B, T = map(int, shape.split("x"))
        q, k, v, g, beta = inputs(B, T, "long")

        def call():
            with torch.no_grad():
                return da.kda(q, k, v, g, beta, use_qk_l2norm=True, backend="triton")[0]

        def unchecked():
            with _checks.values_checked(), torch.no_grad():
                return da.kda(q, k, v, g, beta, use_qk_l2norm=True, backend="triton")[0]

        def unchecked_sync():
            o = unchecked()
            torch.cuda.current_stream().synchronize()
            return o

        unchecked()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                unchecked()
            graph.replay()
            torch.cuda.synchronize()
        except Exception as e:      # noqa: BLE001 (the other rows still run)
            print(f"# {shape}: capture failed: {e!r}", flush=True)
            graph = None

        def replay_sync():
            graph.replay()
            torch.cuda.current_stream().synchronize()

        # the host's issue time: 50 calls queued behind a long GPU job
        big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        for _ in range(3):
            big.zero_()
        t0 = time.perf_counter()
        for _ in range(50):
            unchecked()
        host_us = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        rows = dict(checked=bench(call), unchecked=bench(unchecked), unchecked_sync=bench(unchecked_sync),
                    graph=bench(graph.replay) if graph else float("nan"),
                    graph_sync=bench(replay_sync) if graph else float("nan"), cudnn=bench(cudnn_fn(q, k, v, g, beta)))
        print(f"{shape} " + " ".join(f"{n} {ms:.3f}" for n, ms in rows.items()) + f" host_us {host_us:.0f}",
              flush=True)


if __name__ == "__main__":
    main()
