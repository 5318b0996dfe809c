"""Decode calls on the GPU: eager (back-to-back calls, host-bound at small shapes) vs CUDA-graph replay.

Eager twice: with the value checks (one host read of state_indices / cache_seqlens per call) and with
DELTA_ATTN_SKIP_VALUE_CHECKS=1. Per call wall time: N calls issued back to back then one synchronize, divided by N (no L2 flush: this is the
host-launch rate, not the memory bound). Shapes: B sequences, H=16, K=V=D=128, bf16, one token; kvcache:
B sequences, cache 8192 (contiguous), Hq=32, Hk=8, D=128, one new token written.
"""
import json, os, sys, time
import torch
import delta_attn as da
from steps_vs_copy_common import capture

dev = torch.device("cuda")


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def graph_us(fn, n=300):
    return per_call_us(capture(fn).replay, n)


def main():
    rows = []
    for B in (1, 8, 64):
        H, D = 16, 128
        q, k, v = (torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, D, device=dev)).to(torch.bfloat16)
        beta = torch.rand(B, 1, H, device=dev, dtype=torch.bfloat16)
        pool = torch.zeros(2 * B, H, D, D, device=dev)
        idx = torch.arange(B, device=dev, dtype=torch.int32) * 2
        dpool = torch.zeros(2 * B, H, D, device=dev)
        kq = torch.randn(B, 1, 32, D, device=dev, dtype=torch.bfloat16)
        kc, vc = (torch.randn(B, 8192, 8, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        kn, vn = (torch.randn(B, 1, 8, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((B,), 4000, device=dev, dtype=torch.int32)
        ops = {
            "kda_step": lambda: da.kda_step(q, k, v, g, beta, pool, state_indices=idx, use_qk_l2norm=True),
            "gated_diag_step": lambda: da.gated_diag_step(q, k, v, g, dpool, state_indices=idx),
            "flash_attn_with_kvcache": lambda: da.flash_attn_with_kvcache(kq, kc, vc, k=kn, v=vn, cache_seqlens=lens,
                                                                          causal=True),
        }
        for name, fn in ops.items():
            os.environ["DELTA_ATTN_SKIP_VALUE_CHECKS"] = "0"
            eager = per_call_us(fn)
            os.environ["DELTA_ATTN_SKIP_VALUE_CHECKS"] = "1"
            eager_skip = per_call_us(fn)
            r = dict(op=name, B=B, eager_us=eager, eager_skip_value_checks_us=eager_skip, graph_us=graph_us(fn))
            rows.append(r); print(json.dumps(r), flush=True)
    print(f"{'op':24s} {'B':>4s} {'eager us':>9s} {'eager, skip checks':>18s} {'graph us':>9s}")
    for r in rows:
        print(f"{r['op']:24s} {r['B']:4d} {r['eager_us']:9.2f} {r['eager_skip_value_checks_us']:18.2f} {r['graph_us']:9.2f}")


if __name__ == "__main__":
    main()
