"""Where cuDNN frontend's KDA (``backend="cudnn"``, our adapter) beats our Triton KDA: batches of equal
sequences at a fixed token count, forward and forward+backward, both decay regimes (bf16, H = 16, K = V = 128).

python benchmarks/experiments/kda_auto_crossover.py [--tokens 65536] [--lengths 512,1024,...]
Forward: q/k L2-normed in the kernel, raw log decays. Forward+backward: q/k normalised once outside the timed call
(the form cuDNN's backward takes), both backends on the same tensors. Prints one JSON line per point and a table
of triton ms, cudnn ms and cudnn/triton speed (>1: cuDNN faster): what ``auto``'s KDA rule (ops/kda/register.py)
is set from.
"""
import argparse
import json

import torch
import triton

import delta_attn as da

H, D = 16, 128


def inputs(B, T, regime, grad, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D) for _ in range(3))
    if grad:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    q, k, v = (x.bfloat16().requires_grad_(grad) for x in (q, k, v))
    g = torch.nn.functional.logsigmoid(r(B, T, H, D) + (4.0 if regime == "long" else 0.0))
    beta = torch.rand(B, T, H, device="cuda", generator=gen)
    return q, k, v, g.requires_grad_(grad), beta.requires_grad_(grad)


def fn(backend, x, grad):
    q, k, v, g, beta = x
    do = torch.randn_like(v)

    def call():
        if grad:
            o, _ = da.kda(q, k, v, g, beta, backend=backend)
            torch.autograd.grad(o, (q, k, v, g, beta), do)
            return o
        with torch.no_grad():
            return da.kda(q, k, v, g, beta, use_qk_l2norm=True, backend=backend)[0]
    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--regimes", default="long,strong")
    a = ap.parse_args()
    rows = []
    for grad in (False, True):
        for regime in a.regimes.split(","):
            for T in map(int, a.lengths.split(",")):
                B = max(1, a.tokens // T)
                x = inputs(B, T, regime, grad)
                row = dict(mode="fwd+bwd" if grad else "fwd", regime=regime, B=B, T=T)
                outs = {}
                for backend in ("triton", "cudnn"):
                    try:
                        call = fn(backend, x, grad)
                        outs[backend] = call().float()
                        row[backend] = triton.testing.do_bench(call, warmup=10, rep=100, return_mode="median")
                    except Exception as e:  # noqa: BLE001
                        row[backend] = float("nan")
                        row[backend + "_error"] = f"{type(e).__name__}: {str(e)[:160]}"
                if len(outs) == 2:
                    a, b = outs["triton"].detach(), outs["cudnn"].detach()
                    row["rel_diff"] = float((a - b).abs().max() / a.abs().max())
                row["cudnn_speedup"] = row["triton"] / row["cudnn"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                del x, outs
                torch.cuda.empty_cache()
    print(f"\n# {torch.cuda.get_device_name()}, {a.tokens} tokens per batch")
    print("| mode | decays | B x T | triton ms | cudnn ms | cudnn speed-up | rel diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['regime']} | {r['B']}x{r['T']} | {r['triton']:.3f} | {r['cudnn']:.3f} | "
              f"{r['cudnn_speedup']:.2f} | {r.get('rel_diff', float('nan')):.1e} |")


if __name__ == "__main__":
    main()
