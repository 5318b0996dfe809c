"""Measure the attention backends side by side and check the auto policy against them.

    PYTHONPATH=src python benchmarks/dispatch_bench.py [--out DIR] [--quick]

Dense shapes of the flash issue (B*S = 32768, H*D = 2048, bf16) and the mixed varlen batch of
ANCHORS.md (16 causal sequences of 256..8192 tokens, 66,816 tokens, H = 16, D = 128): delta-attn's
backends (cudnn, sdpa, triton when registered, auto) next to the raw PyTorch peers (SDPA's cuDNN,
FlashAttention-2 and memory-efficient kernels, torch varlen_attn, one cuDNN SDPA call per sequence,
the batch padded to 8192). Correctness is checked against the float64 reference (on a slice: the
last 256 query rows of two heads) before timing; a failing row is FAILED with no speed. Times are
triton.testing.do_bench medians (L2 flushed between repeats) with the 20/80% quantiles.
Also: the cudnn-frontend graph cache over a loop whose cu_seqlens change every step, and the
latency of a small call (host overhead).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import delta_attn as da
from delta_attn import reference
from delta_attn.backends import BACKENDS
from delta_attn.testing import check

DT = torch.bfloat16
VARLEN_LENS = [4096, 256, 7680, 512, 6656, 512, 5632, 1536, 8192, 2048, 7168, 3072, 6144, 3584, 5120, 4608]
assert sum(VARLEN_LENS) == 66816 and len(VARLEN_LENS) == 16


def bench(fn, grad_to_none=None):
    from triton.testing import do_bench
    med, lo, hi = do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
    return med, lo, hi


def flops_dense(b, s, h, d, causal):
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def env_block():
    from delta_attn.env import collect
    info = collect()
    info.pop("backends", None)
    return info


def sdpa_peer(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"cudnn_sdpa": SDPBackend.CUDNN_ATTENTION, "fa2_sdpa": SDPBackend.FLASH_ATTENTION,
               "memeff_sdpa": SDPBackend.EFFICIENT_ATTENTION}[kind]

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal, enable_gqa=k.shape[2] != q.shape[2]
                                                  ).transpose(1, 2)
    return run


def ours(backend):
    def run(q, k, v, causal):
        return da.flash_attn_func(q, k, v, causal=causal, backend=backend)
    return run


def gate_dense(fn, q, k, v, causal):
    """Check fn's last 256 rows of heads 0..1 of batch 0 against the float64 reference."""
    with torch.no_grad():
        out = fn(q, k, v, causal)
    n = min(256, q.shape[1])
    kh = 2 if k.shape[2] == q.shape[2] else 1     # with GQA (group >= 2) q heads 0, 1 read kv head 0
    qs, ks, vs = q[:1, -n:, :2], k[:1, :, :kh], v[:1, :, :kh]
    r64, _ = reference.attention(qs.double(), ks.double(), vs.double(), causal=causal)
    rlo, _ = reference.attention(qs, ks, vs, causal=causal, upcast=False)
    return check(out[:1, -n:, :2], r64, rlo, name="out")


def dense_rows(shapes, methods, results, log, deadline=None):
    for shape in shapes:
        b, s, h, d, causal = shape[:5]
        hk = shape[5] if len(shape) > 5 else h
        if deadline is not None and time.time() > deadline:
            log(dict(kind="dense", B=b, S=s, H=h, D=d, causal=causal, method="*", status="SKIPPED: time budget"))
            continue
        torch.manual_seed(0)
        q = torch.randn(b, s, h, d, device="cuda", dtype=DT, requires_grad=True)
        k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=DT, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        fl = flops_dense(b, s, h, d, causal)
        chosen = da.explain(da.flash_attn_func, q, k, v, causal=causal).chosen
        for name, fn in methods:
            row = dict(kind="dense", B=b, S=s, H=h, Hk=hk, D=d, causal=causal, method=name)
            if name == "auto":
                row["auto_chose"] = chosen
            try:
                v_ = gate_dense(fn, q, k, v, causal)
                row["check"] = v_.message
                if not v_.ok:
                    row["status"] = "FAILED"
                    results.append(row)
                    log(row)
                    continue
                with torch.no_grad():      # inference forward
                    med, lo, hi = bench(lambda: fn(q, k, v, causal))
                row.update(fwd_ms=med, fwd_lo=lo, fwd_hi=hi, fwd_tflops=fl / med / 1e9)

                def fb():
                    fn(q, k, v, causal).backward(dout)
                med, lo, hi = bench(fb, grad_to_none=[q, k, v])
                row.update(fb_ms=med, fb_lo=lo, fb_hi=hi, fb_tflops=3.5 * fl / med / 1e9, status="ok")
            except Exception as e:   # noqa: BLE001 — a peer that cannot run is a row that says so
                row["status"] = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            results.append(row)
            log(row)
        del q, k, v, dout
        torch.cuda.empty_cache()


def varlen_rows(methods_names, results, log, lens=VARLEN_LENS, h=16, d=128):
    torch.manual_seed(0)
    t = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    mx = max(lens)
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=DT, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    useful = sum(4.0 * h * d * L * L / 2 for L in lens)
    bounds = cu.tolist()

    def backend_fn(name):
        return lambda: da.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True, backend=name)

    def varlen_attn_fn():
        from torch.nn.attention.varlen import varlen_attn
        return varlen_attn(q, k, v, cu, cu, mx, mx, window_size=(-1, 0))

    def loop_fn():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        outs = []
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for i in range(len(lens)):
                a, b_ = bounds[i], bounds[i + 1]
                qi, ki, vi = (x[a:b_].unsqueeze(0).transpose(1, 2) for x in (q, k, v))
                outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)[0].transpose(0, 1))
        return torch.cat(outs, 0)

    qp, kp, vp = (torch.zeros(len(lens), mx, h, d, device="cuda", dtype=DT) for _ in range(3))
    for i in range(len(lens)):
        a, b_ = bounds[i], bounds[i + 1]
        qp[i, :b_ - a], kp[i, :b_ - a], vp[i, :b_ - a] = q.detach()[a:b_], k.detach()[a:b_], v.detach()[a:b_]
    for x in (qp, kp, vp):
        x.requires_grad_()
    doutp = torch.randn_like(qp)

    def padded_fn():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                                  is_causal=True).transpose(1, 2)

    fns = {n: backend_fn(n) for n in ("auto", "cudnn", "sdpa", "triton")}
    from delta_attn.ops import cudnn as C
    # variants of backend="cudnn": module knobs held for the whole row (forward and backward)
    knobs = {"cudnn[bottom_right]": dict(TOP_LEFT_WHEN_EQUAL=False), "cudnn[heur_B]": dict(HEUR_MODES=("B", "FALLBACK"))}
    for n in knobs:
        fns[n] = fns["cudnn"]
    fns.update(varlen_attn=varlen_attn_fn, cudnn_per_seq_loop=loop_fn, cudnn_padded_8192=padded_fn)
    # reference slice: the last 256 rows of the longest sequence, heads 0..1
    i = max(range(len(lens)), key=lambda j: lens[j])
    a, b_ = bounds[i], bounds[i + 1]
    qs, ks, vs = q.detach()[b_ - 256:b_, :2][None], k.detach()[a:b_, :2][None], v.detach()[a:b_, :2][None]
    r64, _ = reference.attention(qs.double(), ks.double(), vs.double(), causal=True)
    rlo, _ = reference.attention(qs, ks, vs, causal=True, upcast=False)
    for name in methods_names:
        fn = fns[name]
        saved = {k_: getattr(C, k_) for k_ in knobs.get(name, {})}
        for k_, v_ in knobs.get(name, {}).items():
            setattr(C, k_, v_)
        row = dict(kind="varlen", tokens=t, H=h, D=d, method=name)
        if name == "auto":
            row["auto_chose"] = da.explain(da.flash_attn_varlen_func, q, k, v, cu, cu, mx, mx, causal=True).chosen
        try:
            with torch.no_grad():
                out = fn()
            if name == "cudnn_padded_8192":
                got = out[i, lens[i] - 256:lens[i], :2][None]
            else:
                got = out[b_ - 256:b_, :2][None]
            v_ = check(got, r64, rlo, name="out")
            row["check"] = v_.message
            if not v_.ok:
                row["status"] = "FAILED"
                results.append(row)
                log(row)
                continue
            with torch.no_grad():          # inference forward (auto then sees no backward)
                med, lo, hi = bench(fn)
            row.update(fwd_ms=med, fwd_lo=lo, fwd_hi=hi, fwd_tflops=useful / med / 1e9)
            if name == "cudnn_padded_8192":
                def fb():
                    padded_fn().backward(doutp)
                grads = [qp, kp, vp]
            else:
                def fb():
                    fn().backward(dout)
                grads = [q, k, v]
            med, lo, hi = bench(fb, grad_to_none=grads)
            row.update(fb_ms=med, fb_lo=lo, fb_hi=hi, fb_tflops=3.5 * useful / med / 1e9, status="ok")
        except Exception as e:   # noqa: BLE001
            row["status"] = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        for k_, v_ in saved.items():
            setattr(C, k_, v_)
        results.append(row)
        log(row)


def cache_loop(results, log, steps=40, h=16, d=128, layout="thd"):
    """fwd+bwd through backend="cudnn" with new random cu_seqlens every step."""
    from delta_attn.ops import cudnn as C
    C.clear_graph_cache()
    C.graph_cache_stats(reset=True)
    rng = random.Random(0)
    times = []
    for step in range(steps):
        # packed training: 8..24 documents of 256..8192 tokens, at most 65,536 tokens per step
        n = rng.randint(8, 24)
        lens = []
        for _ in range(n):
            L = rng.randint(256, 8192)
            if sum(lens) + L > 65536:
                break
            lens.append(L)
        t = sum(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        shape = (t, h, d) if layout == "thd" else (h, t, d)
        q, k, v = (torch.randn(shape, device="cuda", dtype=DT, requires_grad=True) for _ in range(3))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = da.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, layout=layout,
                                        backend="cudnn")
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    s = C.graph_cache_stats()
    row = dict(kind="graph_cache", layout=layout, steps=steps, builds=s["builds"], hits=s["hits"],
               hit_rate=s["hit_rate"], build_seconds=s["build_seconds"],
               first_step_s=times[0], median_step_s=sorted(times)[len(times) // 2], max_step_s=max(times))
    results.append(row)
    log(row)


def small_call(results, log):
    torch.manual_seed(0)
    lens = [128, 77, 200, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), 16, 128, device="cuda", dtype=DT) for _ in range(3))
    for name in ("cudnn", "sdpa", "triton"):
        row = dict(kind="small_varlen_latency", tokens=sum(lens), method=name)
        try:
            fn = lambda: da.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200, causal=True, backend=name)  # noqa: E731
            fn()
            med, lo, hi = bench(fn)
            t0 = time.perf_counter()
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            row.update(gpu_us=med * 1e3, wall_us_per_call=(time.perf_counter() - t0) * 1e4, status="ok")
        except Exception as e:   # noqa: BLE001
            row["status"] = f"ERROR {type(e).__name__}: {str(e)[:200]}"
        results.append(row)
        log(row)


def profile_small(out_dir, log):
    """Where the host time of a small cudnn varlen forward goes."""
    import cProfile
    import io
    import pstats
    lens = [128, 77, 200, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), 16, 128, device="cuda", dtype=DT) for _ in range(3))
    with torch.no_grad():
        for _ in range(20):
            da.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200, causal=True, backend="cudnn")
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            da.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200, causal=True, backend="cudnn")
        pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
    with open(os.path.join(out_dir, "profile_small.txt"), "w") as f:
        f.write(buf.getvalue())
    log(dict(kind="profile_small", top=buf.getvalue()[:3000]))


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def render(results, env, cmd):
    lines = [f"command: `{cmd}`", f"date: {datetime.datetime.utcnow().isoformat(timespec='seconds')}Z", "",
             "```", json.dumps(env, indent=1, default=str), "```", ""]
    lines += ["| shape | method | status | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if r["kind"] == "dense":
            shape = (f"B{r['B']} S{r['S']} H{r['H']}" + (f"/{r['Hk']}kv" if r.get("Hk", r["H"]) != r["H"] else "")
                     + f" D{r['D']} {'causal' if r['causal'] else 'full'}")
        elif r["kind"] == "varlen":
            shape = f"varlen {r['tokens']} tok H{r['H']} D{r['D']} causal"
        else:
            continue
        m = r["method"] + (f" (-> {r['auto_chose']})" if "auto_chose" in r else "")
        lines.append(f"| {shape} | {m} | {r.get('status', '?')[:60]} | {fmt(r.get('fwd_ms'), 3)} | "
                     f"{fmt(r.get('fwd_tflops'))} | {fmt(r.get('fb_ms'), 3)} | {fmt(r.get('fb_tflops'))} |")
    lines.append("")
    for r in results:
        if r["kind"] not in ("dense", "varlen"):
            lines.append("- " + json.dumps(r, default=str))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--budget-s", type=float, default=230.0, help="skip remaining dense shapes after this")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    logf = open(os.path.join(args.out, "dispatch_bench.log"), "w")

    def log(row):
        line = json.dumps(row, default=str)
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    start = time.time()
    env = env_block()
    log(dict(kind="env", **{k: env[k] for k in ("torch", "cuda", "cudnn", "triton", "gpu", "git_revision")}))
    has_triton = "flash" in BACKENDS["triton"].capabilities
    methods = [("auto", ours("auto")), ("cudnn", ours("cudnn")), ("sdpa", ours("sdpa"))]
    if has_triton:
        methods.append(("triton", ours("triton")))
    methods += [(n, sdpa_peer(n)) for n in ("cudnn_sdpa", "fa2_sdpa", "memeff_sdpa")]
    shapes = [(8, 4096, 16, 128, False), (8, 4096, 16, 128, True), (2, 16384, 16, 128, False),
              (2, 16384, 16, 128, True), (2, 16384, 32, 64, True), (8, 4096, 16, 128, True, 2)]
    if args.quick:
        shapes = shapes[1:2]
    varlen_methods = ["auto", "cudnn", "sdpa"] + (["triton"] if "flash_varlen" in BACKENDS["triton"].capabilities
                                                  else []) + ["cudnn[bottom_right]", "cudnn[heur_B]", "varlen_attn",
                                                              "cudnn_per_seq_loop", "cudnn_padded_8192"]
    for section in ("varlen", "cache", "small", "profile", "dense"):
        try:
            if section == "varlen":
                varlen_rows(varlen_methods, results, log)
            elif section == "cache":
                cache_loop(results, log, steps=10 if args.quick else 40)
                cache_loop(results, log, steps=6 if args.quick else 12, layout="htd")
            elif section == "small":
                small_call(results, log)
            elif section == "profile":
                profile_small(args.out, log)
            elif section == "dense" and not args.skip_dense:
                dense_rows(shapes, methods, results, log, deadline=start + args.budget_s)
        except Exception:   # noqa: BLE001
            log(dict(kind="section_error", section=section, tb=traceback.format_exc()[-2000:]))
        torch.cuda.empty_cache()
    cmd = "PYTHONPATH=src python " + " ".join(sys.argv)
    md = render(results, env, cmd)
    with open(os.path.join(args.out, "dispatch_bench.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "dispatch_bench.json"), "w") as f:
        json.dump(dict(env=env, results=results), f, default=str, indent=1)
    print(md)


if __name__ == "__main__":
    main()
