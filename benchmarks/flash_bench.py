"""Flash attention on the GPU: delta-attn's Triton kernels vs cuDNN SDPA vs FA2 SDPA, one run.

    PYTHONPATH=src python benchmarks/flash_bench.py                 # the issue's shapes, bf16
    PYTHONPATH=src python benchmarks/flash_bench.py --mem131k       # + causal fwd+bwd at S = 131072
    PYTHONPATH=src python benchmarks/flash_bench.py --sweep 2,16384,16,128,1   # time each config

Protocol: bf16, fixed seed; correctness before timing (ours must be as close to cuDNN as FA2 is:
max |ours - cudnn| <= 2 x max |fa2 - cudnn| + 2e-3 for the output, 3 x + 2e-3 relative for the
gradients), else the row says FAILED; ``triton.testing.do_bench`` median (L2 flushed between
repeats) with the 20/80 % quantiles; FLOPs as in ANCHORS.md (4 B H S^2 D, halved for causal,
x3.5 for fwd+bwd). The forward is timed without autograd (inference), fwd+bwd with
``out.backward(do)``. SDPA gets contiguous (B, H, S, D) tensors, ours (B, S, H, D).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import delta_attn as da  # noqa: E402
from delta_attn.ops.flash import triton_impl  # noqa: E402

ISSUE_SHAPES = [  # (B, S, H, D, causal): B * S = 32768
    (8, 4096, 16, 128, False), (8, 4096, 16, 128, True),
    (2, 16384, 16, 128, False), (2, 16384, 16, 128, True),
    (2, 16384, 32, 64, False), (2, 16384, 32, 64, True),
]


def env() -> dict:
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        drv = "?"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except Exception:
        rev = "?"
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=torch.cuda.get_device_name(), driver=drv, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(), torch=torch.__version__, triton=triton.__version__,
                delta_attn=da.__version__, git=rev)


def flops(b, s, h, d, causal, mode):
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


def ours(q, k, v, causal):
    return da.flash_attn_func(q, k, v, causal=causal, backend="triton")


def _sdpa(backend):
    def f(q, k, v, causal):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


METHODS = {"triton": (ours, "bshd"), "cudnn": (_sdpa(SDPBackend.CUDNN_ATTENTION), "bhsd"),
           "fa2": (_sdpa(SDPBackend.FLASH_ATTENTION), "bhsd")}


def _time(fn, grad_to_none=None, rep=200):
    ms, lo, hi = do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
    return ms, lo, hi


def bench_shape(b, s, h, d, causal, log, rep=200):
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    inputs = {"bshd": [t.clone().requires_grad_() for t in (q, k, v)],
              "bhsd": [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]}
    dos = {"bshd": do, "bhsd": do.transpose(1, 2).contiguous()}
    # correctness: outputs and gradients of every method, in (B, S, H, D)
    results, first = {}, {}
    for name, (fn, lay) in METHODS.items():
        xs = inputs[lay]
        try:
            t0 = time.perf_counter()
            out = fn(*xs, causal)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            grads = torch.autograd.grad(out, xs, dos[lay])
            torch.cuda.synchronize()
            first[name] = (t1 - t0, time.perf_counter() - t0)
            if lay == "bhsd":
                out, grads = out.transpose(1, 2), [g.transpose(1, 2) for g in grads]
            results[name] = (out.float(), [g.float() for g in grads])
        except Exception as e:  # a missing peer is a row that says so
            results[name] = None
            log(f"  {name}: unavailable ({type(e).__name__}: {str(e)[:200]})")
    ok = {"triton": True}
    if results.get("cudnn") and results.get("fa2") and results.get("triton"):
        ref_o, ref_g = results["cudnn"]

        def errs(m):
            o, g = results[m]
            return (float((o - ref_o).abs().max()),
                    [float((a - r).abs().max() / r.abs().max().clamp_min(1e-6)) for a, r in zip(g, ref_g)])
        eo, eg = errs("triton")
        fo, fg = errs("fa2")
        ok["triton"] = eo <= 2 * fo + 2e-3 and all(x <= 3 * y + 2e-3 for x, y in zip(eg, fg))
        log(f"  check vs cuDNN: out max|d| triton {eo:.2e} fa2 {fo:.2e}; grads rel triton "
            + " ".join(f"{x:.1e}" for x in eg) + " fa2 " + " ".join(f"{x:.1e}" for x in fg)
            + ("" if ok["triton"] else "  -> FAILED"))
    del results
    rows = []
    for name, (fn, lay) in METHODS.items():
        xs = inputs[lay]
        if name not in first:
            rows.append(dict(method=name, status="unavailable"))
            continue
        if not ok.get(name, True):
            rows.append(dict(method=name, status="FAILED"))
            continue
        with torch.no_grad():
            f_ms = _time(lambda: fn(*xs, causal), rep=rep)
        bw_ms = _time(lambda: fn(*xs, causal).backward(dos[lay]), grad_to_none=xs, rep=rep)
        rows.append(dict(method=name, status="ok", fwd_ms=f_ms, fwdbwd_ms=bw_ms,
                         fwd_tflops=flops(b, s, h, d, causal, "fwd") / f_ms[0] * 1e-9,
                         fwdbwd_tflops=flops(b, s, h, d, causal, "fwd+bwd") / bw_ms[0] * 1e-9,
                         first_call_s=first[name]))
    del inputs
    torch.cuda.empty_cache()
    return rows


def mem_check(log, s=131072, h=16, d=128):
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):
        q.grad = k.grad = v.grad = None
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = ours(q, k, v, True)
        out.backward(do)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
        del out
    peak = torch.cuda.max_memory_allocated() - base
    ms = sorted(times)[1]
    tf = flops(1, s, h, d, True, "fwd+bwd") / ms * 1e-9
    ok = bool(torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all())
    log(f"S={s} H={h} D={d} causal fwd+bwd: {ms:.1f} ms (median of 3), {tf:.0f} TFLOP/s, "
        f"peak extra memory {peak / 2**30:.2f} GiB (inputs {3 * q.numel() * 2 / 2**30:.2f} GiB), finite grads {ok}")
    return dict(s=s, ms=ms, tflops=tf, peak_extra_gib=peak / 2**30, finite=ok)


_T, _W, _TW = {"USE_TMA": True}, {"WS": True}, {"USE_TMA": True, "WS": True}
# "PIPE": the forward loop software-pipelined by one key block (P.V of block j-1 runs during the
# softmax of block j)
_P, _PT, _PW = {"PIPE": True}, {"PIPE": True, "USE_TMA": True}, {"PIPE": True, "WS": True}
VARLEN_LENGTHS = [256, 512, 1024, 1536, 2048, 2560, 3072, 4096, 4096, 4608, 5120, 6144, 7168, 8192, 8192, 8192]


def bench_varlen(log, h=16, d=128, rep=100):
    """16 causal sequences of 256..8192 tokens packed ("thd"): ours vs cuDNN SDPA one call per
    sequence (and padded to the longest), forward and forward+backward."""
    lens = VARLEN_LENGTHS
    total = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
    useful = sum(4.0 * h * n * n * d / 2 for n in lens)

    def ours_v():
        return da.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, backend="triton")

    segs = [(int(a), int(b)) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    qs, ks, vs = ([t[a:b].detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for a, b in segs]
                  for t in (q, k, v))
    dos = [do[a:b].transpose(0, 1).unsqueeze(0).contiguous() for a, b in segs]
    cudnn = METHODS["cudnn"][0]

    def loop_fwd():
        return [cudnn(a, b, c, True) for a, b, c in zip(qs, ks, vs)]

    def loop_fwdbwd():
        outs = loop_fwd()
        torch.autograd.backward(outs, dos)

    # correctness: the packed output equals the per-sequence cuDNN outputs
    out = ours_v()
    ref = torch.cat([o[0].transpose(0, 1) for o in loop_fwd()], 0)
    err = float((out.float() - ref.float()).abs().max())
    log(f"varlen 16 causal seqs {lens[0]}..{lens[-1]} ({total} tokens, H={h}, D={d}): max|ours - cudnn loop| {err:.2e}")
    rows = {}
    with torch.no_grad():
        rows["triton fwd"] = _time(ours_v, rep=rep)[0]
        rows["cudnn loop fwd"] = _time(loop_fwd, rep=rep)[0]
    rows["triton fwd+bwd"] = _time(lambda: ours_v().backward(do), grad_to_none=[q, k, v], rep=rep)[0]
    rows["cudnn loop fwd+bwd"] = _time(loop_fwdbwd, grad_to_none=qs + ks + vs, rep=rep)[0]
    for name, ms in rows.items():
        mult = 3.5 if "bwd" in name else 1.0
        log(f"  {name:20s} {ms:7.3f} ms  {useful * mult / ms * 1e-9:5.0f} useful TFLOP/s")
    return dict(max_err=err, ms=rows)


SWEEP = {  # (BLOCK_M, BLOCK_N, warps, stages[, forward meta: TMA descriptors, warp specialisation, pipelining])
    "fwd": {128: [(128, 128, 8, 3), (128, 128, 8, 3, _W), (64, 64, 4, 3, _T), (128, 128, 8, 3, _P),
                  (128, 128, 8, 3, _PT), (128, 128, 8, 3, _PW), (64, 64, 4, 3, _PT), (64, 64, 4, 3, _P),
                  (128, 64, 8, 3, _P), (128, 64, 8, 3, _PT)],
            64: [(128, 128, 4, 3, _T), (128, 64, 4, 3, _T), (128, 64, 4, 3, _PT), (128, 128, 8, 3, _P),
                 (128, 128, 8, 3, _PT), (128, 64, 8, 4, _P)]},
    "dkdv": {128: [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 4, 3), (32, 128, 8, 3), (128, 128, 8, 2)],
             64: [(64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 4, 2), (64, 64, 4, 3)]},
    "dq": {128: [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 2)],
           64: [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)]},
}


def sweep(b, s, h, d, causal, log, kinds=("fwd", "dkdv", "dq")):
    """Time every candidate configuration of each kernel (the others fixed at their first entry);
    cuDNN's forward in the same run for scale."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    dc = 64 if d <= 64 else 128
    fl = flops(b, s, h, d, causal, "fwd")
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    c_ms = do_bench(lambda: METHODS["cudnn"][0](qh, kh, vh, causal), warmup=10, rep=60, return_mode="median")
    ref = METHODS["cudnn"][0](qh, kh, vh, causal).transpose(1, 2).float()
    log(f"  cudnn fwd {c_ms:7.3f} ms  {fl / c_ms * 1e-9:5.0f} TFLOP/s")
    scale = d ** -0.5
    wr = 0 if causal else -1
    if any(kind != "fwd" for kind in kinds):   # the backward sweeps need a forward's out / lse
        out, lse = triton_impl.flash_fwd(q, k, v, scale=scale, wl=-1, wr=wr)
    res = {}
    for kind, cfg in [(kind, cfg) for kind in kinds for cfg in SWEEP[kind][dc]]:
        triton_impl.FORCED_CONFIGS.clear()
        triton_impl.FORCED_CONFIGS.update({kk: SWEEP[kk][dc][0] for kk in ("fwd", "dkdv", "dq")})
        triton_impl.FORCED_CONFIGS[kind] = cfg
        try:
            if kind == "fwd":
                fn = lambda: triton_impl.flash_fwd(q, k, v, scale=scale, wl=-1, wr=wr)  # noqa: E731
            else:
                fn = lambda: triton_impl.flash_bwd(do, q, k, v, out, lse, scale=scale, wl=-1, wr=wr)  # noqa: E731
            err = ""
            if kind == "fwd":   # max |ours - cuDNN| of this configuration's output
                err = f"  max|d| {float((fn()[0].float() - ref).abs().max()):.1e}"
            ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
            tf = fl * (1.0 if kind == "fwd" else 2.5) / ms * 1e-9
            log(f"  sweep {kind:4s} {str(cfg):50s} {ms:7.3f} ms  {tf:5.0f} TFLOP/s"
                + (f"  {c_ms / ms:.2f}x cuDNN{err}" if kind == "fwd" else " (whole bwd)"))
            res[f"{kind}{cfg}"] = ms
        except Exception as e:
            log(f"  sweep {kind:4s} {str(cfg):50s} failed: {type(e).__name__} {str(e)[:120]}")
    triton_impl.FORCED_CONFIGS.clear()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="issue", help="'issue' or B,S,H,D,causal;...")
    ap.add_argument("--mem131k", action="store_true")
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--sweep", default="", help="B,S,H,D,causal;... shapes to sweep configs on")
    ap.add_argument("--sweep-kinds", default="fwd,dkdv,dq")
    ap.add_argument("--no-tma", action="store_true", help="forward without TMA descriptors")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    log = lambda m: print(m, flush=True)  # noqa: E731
    torch.zeros(1, device="cuda")
    e = env()
    log("env: " + json.dumps(e))
    log("command: " + " ".join(["python"] + sys.argv))
    triton_impl.FWD_TMA = not a.no_tma
    report = dict(env=e, rows=[], mem=None, sweep={}, fwd_tma=triton_impl.FWD_TMA)
    shapes = ISSUE_SHAPES if a.shapes == "issue" else [
        tuple(int(x) for x in sh.split(",")) for sh in a.shapes.split(";")]
    if not a.no_bench:
        for (b, s, h, d, c) in shapes:
            log(f"shape B={b} S={s} H={h} D={d} causal={bool(c)}")
            rows = bench_shape(b, s, h, d, bool(c), log, rep=a.rep)
            for r in rows:
                r.update(B=b, S=s, H=h, D=d, causal=bool(c))
                if r["status"] == "ok":
                    log(f"  {r['method']:7s} fwd {r['fwd_ms'][0]:7.3f} ms {r['fwd_tflops']:5.0f} TFLOP/s | "
                        f"fwd+bwd {r['fwdbwd_ms'][0]:7.3f} ms {r['fwdbwd_tflops']:5.0f} TFLOP/s | "
                        f"first call fwd {r['first_call_s'][0]:.2f} s, fwd+bwd {r['first_call_s'][1]:.2f} s")
                else:
                    log(f"  {r['method']:7s} {r['status']}")
            report["rows"] += rows
    if a.mem131k:
        report["mem"] = mem_check(log)
    if a.varlen:
        try:
            report["varlen"] = bench_varlen(log)
        except Exception as e:
            log(f"varlen: failed ({type(e).__name__}: {str(e)[:200]})")
    for sh in filter(None, a.sweep.split(";")):
        b, s, h, d, c = (int(x) for x in sh.split(","))
        log(f"sweep B={b} S={s} H={h} D={d} causal={bool(c)}")
        report["sweep"][sh] = sweep(b, s, h, d, bool(c), log, kinds=a.sweep_kinds.split(","))
    if report["rows"]:
        log("\n| D | S | H | causal | ours fwd | cuDNN fwd | FA2 fwd | fwd vs cuDNN | fwd vs FA2 | ours f+b | "
            "cuDNN f+b | FA2 f+b | f+b vs cuDNN | f+b vs FA2 |")
        log("|" + "---|" * 14)
        by = {}
        for r in report["rows"]:
            by.setdefault((r["D"], r["S"], r["H"], r["causal"]), {})[r["method"]] = r
        for (d, s, h, c), m in by.items():
            def tf(name, key):
                r = m.get(name)
                return r[key] if r and r["status"] == "ok" else float("nan")
            o_f, c_f, f_f = tf("triton", "fwd_tflops"), tf("cudnn", "fwd_tflops"), tf("fa2", "fwd_tflops")
            o_b, c_b, f_b = tf("triton", "fwdbwd_tflops"), tf("cudnn", "fwdbwd_tflops"), tf("fa2", "fwdbwd_tflops")
            log(f"| {d} | {s} | {h} | {'yes' if c else 'no'} | {o_f:.0f} | {c_f:.0f} | {f_f:.0f} | {o_f / c_f:.2f} | "
                f"{o_f / f_f:.2f} | {o_b:.0f} | {c_b:.0f} | {f_b:.0f} | {o_b / c_b:.2f} | {o_b / f_b:.2f} |")
        log("(TFLOP/s, bf16, do_bench median)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
