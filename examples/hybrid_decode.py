"""Decode throughput of the hybrid model (KKKA) against an attention-only model (A) of the same size.

    python examples/hybrid_decode.py                                                  # CPU, tiny sizes
    python examples/hybrid_decode.py --device cuda --context 32768 --batch 8 \\
        --hidden 1024 --heads 8 --kv-heads 2 --layers 8 --tokens 128

Both models are randomly initialised with the same sizes. Each is prefilled once (eager) with a random
``--context``-token prompt per row; then ``--tokens`` tokens are decoded eagerly, then ``--tokens`` more
with the captured CUDA-graph step (``cuda_graph=True``, CUDA only), from the same caches. The table
gives tokens/s over the batch (batch * tokens / seconds); the graph time includes its one eager warm-up
step and the capture. Nothing is quoted here: the numbers depend on the machine and library version.
"""
from __future__ import annotations

import argparse
import time

import torch

from delta_attn.nn import HybridConfig, HybridLM


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def bench(pattern: str, args, dev: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(args.seed)
    cfg = HybridConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                       num_kv_heads=args.kv_heads, pattern=pattern, backend=args.backend)
    model = HybridLM(cfg).to(dev, dtype).eval()
    ids = torch.randint(0, args.vocab, (args.batch, args.context), device=dev)
    modes = [False, True] if dev.type == "cuda" else [False]
    warm = 3
    sync(dev)
    t0 = time.perf_counter()
    cache, last = model.prefill(ids, (warm + args.tokens) * len(modes), page_size=args.page_size)
    sync(dev)
    row = {"prefill_s": time.perf_counter() - t0}
    model.decode(cache, last, warm, cuda_graph=False)          # compiles the step kernels
    for graph in modes:
        sync(dev)
        t0 = time.perf_counter()
        model.decode(cache, last, args.tokens, cuda_graph=graph)
        sync(dev)
        row["graph" if graph else "eager"] = args.batch * args.tokens / (time.perf_counter() - t0)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-bench", action="store_true", help="accepted for older commands: the benchmark is what "
                                                                   "this script runs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32 (default on CPU)")
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4, help="decoded tokens timed per mode")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    print(f"{dev.type}, {dtype}, backend {args.backend}: batch {args.batch}, context {args.context}, "
          f"{args.tokens} tokens per mode, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
          f"({args.kv_heads} kv heads)", flush=True)
    rows = {name: bench(pattern, args, dev, dtype) for name, pattern in (("hybrid KKKA", "KKKA"),
                                                                          ("attention A", "A"))}
    print(f"{'model':<12} {'prefill s':>10} {'eager tok/s':>12} {'graph tok/s':>12}")
    for name, r in rows.items():
        graph = f"{r['graph']:12.1f}" if "graph" in r else f"{'-':>12}"
        print(f"{name:<12} {r['prefill_s']:10.2f} {r['eager']:12.1f} {graph}")


if __name__ == "__main__":
    main()
