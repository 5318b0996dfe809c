"""Back-to-back KDA prefill calls (``da.kda`` under no_grad, 8x4096, bf16 q / k / v, float32 g with long-memory
decays, H = 16, K = V = 128): a cProfile of 200 calls with the value check, then the wall time per call of 200 calls
in a row with and without it (``DELTA_ATTN_SKIP_VALUE_CHECKS``), both as issued by the host and once the GPU is done.

python benchmarks/experiments/kda_prefill_host.py
"""
import cProfile
import os
import pstats
import time

import torch

import delta_attn as da

B, T, H, D = 8, 4096, 16, 128
CALLS = 200


def calls(q, k, v, g, beta):
    for _ in range(CALLS):
        da.kda(q, k, v, g, beta, use_qk_l2norm=True)


def main():
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, device="cuda") + 4)
    beta = torch.rand(B, T, H, device="cuda")
    with torch.no_grad():
        for _ in range(5):
            da.kda(q, k, v, g, beta, use_qk_l2norm=True)
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        calls(q, k, v, g, beta)
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
        for checked in (True, False):
            os.environ["DELTA_ATTN_SKIP_VALUE_CHECKS"] = "" if checked else "1"
            t0 = time.perf_counter()
            calls(q, k, v, g, beta)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"checked={checked}: host {1e3 * (t1 - t0) / CALLS:.3f} ms per call issued, "
                  f"{1e3 * (t2 - t0) / CALLS:.3f} ms per call done")


if __name__ == "__main__":
    main()
