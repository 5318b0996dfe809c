"""KDA against its peers at the bar shapes, in one process: delta-attn (Triton), FLA ``chunk_kda`` and the cuDNN
frontend's ``kimi_delta_attention``. H = 16, K = V = 128, bf16; ``delta_attn.bench.timer.measure`` (L2 flushed,
CUDA events, median).

* forward, q / k L2-normalised in the kernel;
* forward + backward in the form cuDNN-FE trains (q / k pre-normalised, float32 beta), gradients reset;
* first forward + backward in a fresh process (compilation included);
* decode of one token for 64 sequences under CUDA-graph replay (fp32 state read and written).

Correctness comes first: at each shape every implementation's output is compared with ours, and ours with the
float64 reference on the first 2048 tokens of sequence 0 (DESIGN.md's rule against the bf16 recurrence); a row
that fails prints FAILED and no time. A missing peer is a row that says so.

    PYTHONPATH=src python benchmarks/kda_bench.py [--out DIR] [--shapes 8x4096 1x32768 64x1024] [--no-cold]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import delta_attn as da
from delta_attn import reference as ref
from delta_attn.bench.timer import measure
from delta_attn.env import collect
from delta_attn.testing import check

H, K, V = 16, 128, 128
DEV = torch.device("cuda")


def inputs(B, T, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)      # noqa: E731
    q, k, v = (r(B, T, H, K).bfloat16() for _ in range(3))
    g = F.logsigmoid(r(B, T, H, K) + 3.0)                            # fp32 log decay
    beta = torch.rand(B, T, H, device=DEV, generator=gen)            # fp32
    return q, k, v, g, beta


def peers():
    out = {}
    try:
        from fla.ops.kda import chunk_kda
        out["fla"] = chunk_kda
    except Exception as e:  # noqa: BLE001
        out["fla"] = f"not available: {type(e).__name__}: {e}"[:200]
    try:
        from cudnn.linear_attention import kimi_delta_attention
        out["cudnn"] = kimi_delta_attention
    except Exception as e:  # noqa: BLE001
        out["cudnn"] = f"not available: {type(e).__name__}: {e}"[:200]
    return out


def runners(P, B, T, l2: bool, fla: bool = True):
    """name -> fn(q, k, v, g, beta) returning o (B, T, H, V)."""
    cu = torch.arange(0, B + 1, device=DEV, dtype=torch.int32) * T
    fns = {"ours": lambda q, k, v, g, b: da.kda(q, k, v, g, b, use_qk_l2norm=l2, backend="triton")[0]}
    if callable(P["fla"]) and fla:
        fns["fla"] = lambda q, k, v, g, b: P["fla"](q, k, v, g, b, use_qk_l2norm_in_kernel=l2)[0]
    if callable(P["cudnn"]):
        def cudnn_fn(q, k, v, g, b):
            flat = lambda x: x.reshape(B * T, *x.shape[2:])        # noqa: E731
            o = P["cudnn"](flat(q), flat(k), flat(v), flat(g), flat(b), cu, use_qk_l2norm_in_kernel=l2)
            return (o[0] if isinstance(o, tuple) else o).view(B, T, H, V)
        fns["cudnn"] = cudnn_fn
    return fns


def gate(name, o, o_ours, xs, B, T):
    """Ours against float64 on a prefix; every implementation against ours at full size."""
    if name == "ours":
        n = min(T, 2048)
        sl = [x[:1, :n] for x in xs]
        r64 = ref.kda(*[x.double() for x in sl], use_qk_l2norm=True)[0]
        low = ref.kda(*sl, use_qk_l2norm=True, upcast=False)[0]
        v = check(o[:1, :n], r64, low)
        return v.ok, v.message
    rel = ((o.float() - o_ours.float()).norm() / o_ours.float().norm()).item()
    return rel < 2e-2, f"relative L2 difference to ours {rel:.2e}"


def bench_shape(P, B, T, rows, fla_train: bool):
    xs = inputs(B, T)
    q, k, v, g, beta = xs
    # forward, L2 norm in the kernel, no gradient
    o_ours = None
    with torch.no_grad():
        for name, fn in runners(P, B, T, True).items():
            row = dict(shape=f"{B}x{T}", mode="fwd", impl=name)
            try:
                o = fn(*xs)
                torch.cuda.synchronize()
                o_ours = o if name == "ours" else o_ours
                ok, msg = gate(name, o, o_ours, xs, B, T)
                row["check"] = msg
                if ok:
                    row["ms"] = measure(lambda: fn(*xs), DEV).median_ms
                else:
                    row["status"] = "FAILED"
            except Exception as e:  # noqa: BLE001
                row["status"] = f"error: {type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(row, flush=True)
    # forward + backward, q / k pre-normalised, fp32 beta (cuDNN-FE's training form)
    qn, kn = F.normalize(q.float(), dim=-1).bfloat16(), F.normalize(k.float(), dim=-1).bfloat16()
    do = torch.randn(B, T, H, V, device=DEV, dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (qn, kn, v, g, beta)]
    grads_ours = None
    for name, fn in runners(P, B, T, False, fla_train).items():
        row = dict(shape=f"{B}x{T}", mode="fwd+bwd", impl=name)

        def step():
            for t in leaves:
                t.grad = None
            fn(*leaves).backward(do)
        try:
            step()
            torch.cuda.synchronize()
            gq = leaves[0].grad.float()
            if name == "ours":
                grads_ours = gq
                ok = bool(torch.isfinite(gq).all())
                row["check"] = "dq finite" if ok else "dq not finite"
            else:
                rel = ((gq - grads_ours).norm() / grads_ours.norm()).item()
                ok = rel < 3e-2
                row["check"] = f"dq relative L2 difference to ours {rel:.2e}"
            if ok:
                row["ms"] = measure(step, DEV).median_ms
            else:
                row["status"] = "FAILED"
        except Exception as e:  # noqa: BLE001
            row["status"] = f"error: {type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(row, flush=True)


def bench_decode(rows):
    """One token for 64 sequences from a pool, under CUDA-graph replay and eager."""
    B = 64
    q, k, v, g, beta = inputs(B, 1)
    pool = torch.randn(B, H, K, V, device=DEV) * 0.1
    ref_pool = pool.clone()
    o_ref = da.kda_step(q, k, v, g, beta, ref_pool, use_qk_l2norm=True, backend="torch")
    o = da.kda_step(q, k, v, g, beta, pool.clone(), use_qk_l2norm=True, backend="triton")
    ok = torch.allclose(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    fn = lambda: da.kda_step(q, k, v, g, beta, pool, use_qk_l2norm=True, backend="triton")   # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    state_bytes = 2 * pool.numel() * 4
    for mode, f in (("graph", graph.replay), ("eager", fn)):
        row = dict(shape="64x1", mode=f"decode {mode}", impl="ours", check="matches the torch reference" if ok
                   else "FAILED against the torch reference")
        if ok:
            ms = measure(f, DEV).median_ms
            row.update(ms=ms, state_TBps=state_bytes / ms / 1e9)
        rows.append(row)
        print(row, flush=True)


COLD = r"""
import time, torch, torch.nn.functional as F, delta_attn as da
q, k, v = (torch.randn(8, 4096, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = F.logsigmoid(torch.randn(8, 4096, 16, 128, device="cuda") + 3).requires_grad_()
b = torch.rand(8, 4096, 16, device="cuda", requires_grad=True)
torch.cuda.synchronize(); t0 = time.perf_counter()
da.kda(q, k, v, g, b, use_qk_l2norm=True, backend="triton")[0].sum().backward()
torch.cuda.synchronize(); print(time.perf_counter() - t0)
"""


def bench_cold(rows):
    """First forward+backward in a fresh process with an empty Triton cache (a temporary TRITON_CACHE_DIR)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, TRITON_CACHE_DIR=d)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", COLD], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    row = dict(shape="8x4096", mode="first fwd+bwd, fresh process, empty cache", impl="ours")
    if out.returncode == 0:
        row.update(s=float(out.stdout.strip().splitlines()[-1]), process_s=wall)
    else:
        row["status"] = "error: " + out.stderr[-300:]
    rows.append(row)
    print(row, flush=True)


def table(rows):
    by = {(r["shape"], r["mode"], r["impl"]): r for r in rows}
    lines = ["| shape | mode | ours ms | FLA ms | cuDNN-FE ms | ours vs FLA | ours vs cuDNN-FE |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (shape, mode) in dict.fromkeys((r["shape"], r["mode"]) for r in rows):
        cell = lambda i: by.get((shape, mode, i), {})                       # noqa: E731
        t = lambda i: (f"{cell(i)['ms']:.3f}" if "ms" in cell(i) else (cell(i).get("status", "-")[:30]))  # noqa: E731
        ratio = lambda i: (f"{cell(i)['ms'] / cell('ours')['ms']:.2f}x" if "ms" in cell(i) and "ms" in cell('ours')
                           else "-")                                          # noqa: E731
        lines.append(f"| {shape} | {mode} | {t('ours')} | {t('fla')} | {t('cudnn')} | {ratio('fla')} | "
                     f"{ratio('cudnn')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", nargs="*", default=["8x4096", "1x32768", "64x1024"])
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--fla-train", action="store_true", help="also time FLA forward+backward (autotunes for minutes)")
    args = ap.parse_args()
    P = peers()
    rows = [dict(peer=n, status=s) for n, s in P.items() if not callable(s)]
    for r in rows:
        print(r)
    if not args.no_cold:
        bench_cold(rows)
    for s in args.shapes:
        B, T = map(int, s.split("x"))
        bench_shape(P, B, T, rows, args.fla_train)
        torch.cuda.empty_cache()
    bench_decode(rows)
    md = table([r for r in rows if "impl" in r])
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kda_bench.jsonl"), "w") as f:
            f.write(json.dumps(dict(env=collect(), command=" ".join(sys.argv))) + "\n")
            for r in rows:
                f.write(json.dumps(r) + "\n")
        with open(os.path.join(args.out, "kda_bench.md"), "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
