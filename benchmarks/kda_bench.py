"""KDA benchmark: delta-attn's Triton kernels side by side with flash-linear-attention (fla-core).

H = 16, K = V = 128, bf16, q/k L2-normed in kernel. Rows: forward and forward+backward at
(B=8, T=4096) and (B=1, T=32768) against ``fla.ops.kda.chunk_kda``; decode (B=64, one token,
fp32 state) against ``fla.ops.kda.fused_recurrent_kda``; the cold start (first forward+backward in a
fresh process, compile included); optionally the crossover with cuDNN causal attention at 64K tokens
per batch. Correctness is checked before timing (a failing row prints FAILED, no speed).

    PYTHONPATH=src python benchmarks/kda_bench.py [--crossover] [--cold] [--tune] [--out DIR]
        [--fwd-chunk 16 64] [--fwd-only] [--tune64] [--train-chunk 16 64] [--tune-train64]
        [--fwd-variant default lean lean_dots] [--tune-lean] [--variants-only]

``--fwd-chunk 16 64`` times our forward (no gradient) with each chunk length of
``CONFIG["fwd_chunk"]`` side by side (keys ``ours_fwd16_ms`` / ``ours_fwd64_ms``; ``ours_fwd_ms`` is the
first listed), each checked against the float64 reference first. ``--fwd-only`` skips every
forward+backward and the decode rows (FLA's first forward+backward autotunes for minutes).
``--train-chunk 16 64`` times forward+backward with each ``CONFIG["train_chunk"]`` (keys
``ours_fwdbwd16_ms`` / ``ours_fwdbwd64_ms``; gradients finite and compared with the first listed) and
adds per-chunk-length backward pieces to the breakdown (forward keeping states, backward scan, intra).
``--fwd-variant default lean lean_dots`` first times the 16-token forward (no gradient) with each
``CONFIG["fwd_variant"]`` (the prep kernel; checked against float64 first) next to FLA's forward, and
each prep alone at 8x4096 (``<variant>_prep_ms``); ``--tune-lean`` adds the lean settings (for the last listed variant);
``--variants-only`` stops there.
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
import triton
from triton.testing import do_bench

import delta_attn as da

H, K, V = 16, 128, 128
DEV = "cuda"


def env() -> dict:
    info = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(), gpu=torch.cuda.get_device_name(),
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        info["driver"] = "?"
    try:
        import fla
        info["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        info["fla"] = "not installed"
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        info["git"] = "?"
    return info


def inputs(B, T, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(B, T, H, K, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V, device=DEV, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(B, T, H, K, device=DEV) + 3.0).to(torch.bfloat16)   # typical decays
    beta = torch.rand(B, T, H, device=DEV, dtype=torch.bfloat16)
    return q, k, v, g, beta


def ours(q, k, v, g, beta):
    return da.kda(q, k, v, g, beta, use_qk_l2norm=True, backend="triton")[0]


def fla_chunk(q, k, v, g, beta):
    from fla.ops.kda import chunk_kda
    return chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def bench(fn, reps=None):
    ms = do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.2, 0.8])
    return ms   # median, p20, p80 (ms)


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def fwd_bwd(fn, xs, do):
    xs = [x.detach().requires_grad_(True) for x in xs]

    def step():
        for x in xs:
            x.grad = None
        fn(*xs).backward(do)
    return step, xs


def grads(fn, xs, do):
    step, leaves = fwd_bwd(fn, xs, do)
    step()
    return [x.grad for x in leaves]


def check_forward(B, T):
    """Our forward vs the fp64 reference under the error rule (baseline: the bf16 reference)."""
    from delta_attn import reference as ref
    from delta_attn.testing import check
    Bc = min(B, 1)
    xs = [x[:Bc, :T, :2] for x in inputs(B, T, seed=1)]     # 2 heads of the same shape (reference is slow)
    o = da.kda(*xs, use_qk_l2norm=True, backend="triton")[0]
    r64 = ref.kda(*[x.double() for x in xs], use_qk_l2norm=True)[0]
    low = ref.kda(*xs, use_qk_l2norm=True, upcast=False)[0]
    return check(o, r64, low, name=f"o T={T}")


def fwd_variants(ti, args, have_fla):
    """Forward (no gradient, 16-token chunks) with each CONFIG["fwd_variant"]: checked against the
    float64 reference, then timed at 8x4096 and 1x32768 with FLA's forward in the same process; the
    prep alone at 8x4096; with --tune-lean the lean settings. One JSON line per row, as measured."""
    base = dict(ti.CONFIG)
    sc = K ** -0.5
    ti.CONFIG["fwd_chunk"] = 16
    ok = {}
    for var in args.fwd_variant:
        ti.CONFIG["fwd_variant"] = var
        v = check_forward(1, 4096)
        ok[var] = bool(v.ok)
        print(f"check fwd_variant={var}", v.message, "OK" if v.ok else "FAILED", flush=True)
    ti.CONFIG["fwd_variant"] = "default"

    def prep_fn(var, q, k, v, g, beta):
        """The prep alone, with the chunk length of the variant (lean_chunk for the lean ones)."""
        bt = ti.BT if var == "default" else ti._lean_chunk(q.shape[0] * v.shape[2], K, V, q.device)
        chunk_t = ti._index_tables(q.shape[0], q.shape[1], None, DEV, bt)[1]
        if var == "default":
            return lambda: ti._prep(q, k, v, g, beta, None, None, sc, None, True, chunk_t)
        return lambda: ti._prep_lean(q, k, v, g, beta, None, None, sc, None, True, chunk_t,
                                     inv=int(var == "lean_dots"), bt=bt)

    def rows_for(label, settings, variants):
        if settings:                        # every setting against float64 first
            for var in variants:
                ti.CONFIG.update(base, fwd_chunk=16, fwd_variant=var, **settings)
                v = check_forward(1, 4096)
                ok[var + label] = bool(v.ok)
                print(f"check fwd_variant={var} {label}", v.message, "OK" if v.ok else "FAILED", flush=True)
            ti.CONFIG.update(base)
        for B, T in ((8, 4096), (1, 32768)):
            xs = inputs(B, T)
            row = dict(fwd_variant_row=label, B=B, T=T)
            with torch.no_grad():
                ti.CONFIG.update(base, fwd_chunk=16, fwd_variant="default")
                ref16 = ours(*xs)
                for var in variants:
                    ti.CONFIG.update(base, fwd_chunk=16, fwd_variant=var, **settings)
                    o = ours(*xs)
                    row[f"{var}_rel_err_vs_default"] = rel_err(o, ref16)
                    if ok.get(var) and ok.get(var + label, True) and torch.isfinite(o).all().item():
                        row[f"{var}_fwd_ms"] = bench(lambda: ours(*xs))
                        if B == 8:
                            row[f"{var}_prep_ms"] = bench(prep_fn(var, *xs))
                if have_fla and not args.no_fla and not settings:
                    fla_chunk(*xs)
                    row["fla_fwd_ms"] = bench(lambda: fla_chunk(*xs))
            ti.CONFIG.update(base)
            print(json.dumps(row), flush=True)
            del xs, ref16
            torch.cuda.empty_cache()

    rows_for("variants", {}, args.fwd_variant)
    lean = [args.fwd_variant[-1] if args.fwd_variant[-1] != "default" else "lean_dots"]   # the last listed
    for settings in args.lean_settings or []:             # explicit combinations (JSON objects)
        rows_for(json.dumps(settings), settings, lean)
    if args.tune_lean:
        for settings in (dict(lean_chunk=32), dict(lean_chunk=32, lean_inv_prec="tf32"),
                         dict(lean_ks=64), dict(lean_ks=128), dict(lean_warps=8, lean_stages=2),
                         dict(lean_warps=8, lean_stages=1), dict(lean_stages=2), dict(lean_inv_prec="tf32"),
                         dict(lean_ks=64, lean_warps=8, lean_stages=2), dict(scan_stages=4), dict(scan_warps=4)):
            rows_for(json.dumps(settings), settings, lean)
    ti.CONFIG.update(base)


def config_sweep(ti, rows, label, variants, measure, **fixed):
    """Each CONFIG variant (over the current CONFIG plus ``fixed``) measured by ``measure(variant, row)``;
    an exception becomes the row's "error"; one JSON line per variant; CONFIG restored afterwards."""
    base = dict(ti.CONFIG)
    try:
        for var in variants:
            ti.CONFIG.clear()
            ti.CONFIG.update(base, **fixed, **var)
            res = {label: var}
            try:
                measure(var, res)
            except Exception as e:  # noqa: BLE001
                res["error"] = repr(e)[:300]
            print(json.dumps(res))
            rows.append(res)
    finally:
        ti.CONFIG.clear()
        ti.CONFIG.update(base)


def decode_sweep(ti, Bd=64):
    """Decode (Bd sequences, one token, fp32 state) with each step_bv x step_warps: checked against the
    torch backend, then timed eager (do_bench, L2 flushed) and as a CUDA graph; one JSON line each."""
    from triton.testing import do_bench_cudagraph
    base = dict(ti.CONFIG)
    xs = [x[:, :1].contiguous() for x in inputs(Bd, 1)]
    state = torch.randn(Bd, H, K, V, device=DEV) * 0.1
    ref = state.clone()
    o_ref = da.kda_step(*xs, ref, use_qk_l2norm=True, backend="torch")
    nbytes = 2 * state.numel() * 4
    for bv in (16, 32, 64):
        for warps in (1, 2, 4, 8):
            ti.CONFIG.update(base, step_bv=bv, step_warps=warps)
            s1 = state.clone()
            o = da.kda_step(*xs, s1, use_qk_l2norm=True, backend="triton")
            row = dict(decode_sweep=dict(step_bv=bv, step_warps=warps), rel_err_o=rel_err(o, o_ref),
                       rel_err_state=rel_err(s1, ref))
            row["ok"] = row["rel_err_o"] < 2e-2 and row["rel_err_state"] < 1e-3
            if row["ok"]:
                step = lambda: da.kda_step(*xs, s1, use_qk_l2norm=True, backend="triton")   # noqa: E731
                row["eager_us"] = bench(step)[0] * 1e3
                row["graph_us"] = do_bench_cudagraph(step) * 1e3
                row["eager_TBps"] = nbytes / (row["eager_us"] * 1e-6) / 1e12
                row["graph_TBps"] = nbytes / (row["graph_us"] * 1e-6) / 1e12
            print(json.dumps(row), flush=True)
    ti.CONFIG.update(base)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--crossover", action="store_true")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--check-long", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--cold-only", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--fwd-chunk", type=int, nargs="+", default=[16], help="forward chunk lengths to time (16, 64)")
    ap.add_argument("--fwd-only", action="store_true", help="forward rows only (no fwd+bwd, no decode)")
    ap.add_argument("--tune64", action="store_true", help="forward-only variants of the 64-token path's settings")
    ap.add_argument("--train-chunk", type=int, nargs="+", default=None,
                    help="training chunk lengths to time forward+backward with (16, 64; default: CONFIG's)")
    ap.add_argument("--tune-train64", action="store_true", help="forward+backward variants of the 64-token training path")
    ap.add_argument("--fwd-variant", nargs="+", default=None,
                    help="16-token forward prep variants to time first (CONFIG['fwd_variant']: default lean lean_dots)")
    ap.add_argument("--tune-lean", action="store_true", help="lean prep settings (lean_ks / lean_warps / lean_stages)")
    ap.add_argument("--variants-only", action="store_true", help="stop after the --fwd-variant rows")
    ap.add_argument("--lean-settings", type=json.loads, nargs="+", default=None,
                    help='CONFIG settings to time with the last --fwd-variant, one JSON object each, e.g. '
                         '\'{"lean_inv_prec": "tf32", "scan_warps": 4}\'')
    ap.add_argument("--decode-sweep", action="store_true",
                    help="decode only: step_bv x step_warps, eager and CUDA graph, then stop")
    args = ap.parse_args()
    from delta_attn.ops.kda import triton_impl as ti
    base_chunk = ti.CONFIG["fwd_chunk"]
    base_train = ti.CONFIG["train_chunk"]
    train_chunks = args.train_chunk or [base_train]
    info = env()
    print(json.dumps(info))
    rows = []
    try:
        import fla  # noqa: F401
        have_fla = True
    except ImportError:
        have_fla = False

    # ---------------------------------------------------------------------------------- cold start
    if args.cold or args.cold_only:
        code = ("import time,torch;t=time.time();import delta_attn as da;"
                "import sys;sys.path.insert(0,'benchmarks');from kda_bench import inputs,ours;"
                "xs=[x.requires_grad_(True) for x in inputs(8,4096)];o=ours(*xs);o.sum().backward();"
                "torch.cuda.synchronize();print('COLD',time.time()-t)")
        import tempfile
        envc = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="kda_cold_"))
        t0 = time.time()
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=envc)
        row = dict(cold_start_s=time.time() - t0, inner=r.stdout.strip()[-200:], err=r.stderr[-500:])
        print(json.dumps(row))
        rows.append(row)

    if args.cold_only:
        return
    if args.decode_sweep:
        decode_sweep(ti)
        return
    # ---------------------------------------------------------------------------------- correctness
    chunk_ok = {}
    for c in args.fwd_chunk:
        ti.CONFIG["fwd_chunk"] = c
        for T in ((4096, 32768) if args.check_long else (4096,)):
            v = check_forward(1, T)
            chunk_ok[c] = chunk_ok.get(c, True) and bool(v.ok)
            print(f"check fwd_chunk={c}", v.message, "OK" if v.ok else "FAILED")
    ti.CONFIG["fwd_chunk"] = base_chunk

    # ---------------------------------------------------------------------------------- forward variants
    if args.fwd_variant:
        fwd_variants(ti, args, have_fla)
        if args.variants_only:
            return

    # ---------------------------------------------------------------------------------- ours first
    keep = {}
    for B, T in ((8, 4096), (1, 32768)):
        xs = inputs(B, T)
        do = torch.randn(B, T, H, V, device=DEV, dtype=torch.bfloat16)
        row = dict(B=B, T=T)
        outs = {}
        for c in args.fwd_chunk:        # forward (no gradient) with each chunk length
            ti.CONFIG["fwd_chunk"] = c
            with torch.no_grad():
                outs[c] = ours(*xs)
            okc = chunk_ok.get(c, False) and torch.isfinite(outs[c]).all().item()
            row[f"fwd{c}_ok"] = okc
            if c != args.fwd_chunk[0]:
                row[f"fwd{c}_rel_err_vs_fwd{args.fwd_chunk[0]}"] = rel_err(outs[c], outs[args.fwd_chunk[0]])
            if okc:
                with torch.no_grad():
                    row[f"ours_fwd{c}_ms"] = bench(lambda: ours(*xs))
        ti.CONFIG["fwd_chunk"] = base_chunk
        o = outs[args.fwd_chunk[0]]
        g1 = []
        row["ok"] = row[f"fwd{args.fwd_chunk[0]}_ok"]
        if row["ok"]:
            row["ours_fwd_ms"] = row[f"ours_fwd{args.fwd_chunk[0]}_ms"]
        for c in ([] if args.fwd_only else train_chunks):     # forward+backward with each training chunk
            ti.CONFIG["train_chunk"] = c
            gc_ = grads(ours, xs, do)
            okc = all(torch.isfinite(t).all().item() for t in gc_)
            row[f"train{c}_grads_finite"] = okc
            if g1:
                row[f"train{c}_grad_rel_err_vs_train{train_chunks[0]}"] = {
                    n: rel_err(a, b) for n, a, b in zip("q k v g beta".split(), gc_, g1)}
            else:
                g1 = gc_
            if okc and row["ok"]:
                step, _ = fwd_bwd(ours, xs, do)
                row[f"ours_fwdbwd{c}_ms"] = bench(step)
            del gc_
        ti.CONFIG["train_chunk"] = base_train
        if not args.fwd_only:
            row["ok"] = row["ok"] and row.get(f"train{train_chunks[0]}_grads_finite", False)
            if f"ours_fwdbwd{train_chunks[0]}_ms" in row:
                row["ours_fwdbwd_ms"] = row[f"ours_fwdbwd{train_chunks[0]}_ms"]
        keep[(B, T)] = (o, g1)
        del outs
        print(json.dumps(row))
        rows.append(row)
        torch.cuda.empty_cache()

    # ---------------------------------------------------------------------------------- decode
    Bd = 64
    drow = dict(decode_B=Bd, skipped="--fwd-only")
    if not args.fwd_only:
        xs = [x[:, :1].contiguous() for x in inputs(Bd, 1)]
        state = torch.randn(Bd, H, K, V, device=DEV) * 0.1
        s1, s2 = state.clone(), state.clone()
        o1 = da.kda_step(*xs, s1, use_qk_l2norm=True, backend="triton")
        o2 = da.kda_step(*xs, s2, use_qk_l2norm=True, backend="torch")
        drow = dict(decode_B=Bd, ok=rel_err(o1, o2) < 2e-2 and rel_err(s1, s2) < 1e-3,
                    rel_err_o=rel_err(o1, o2), rel_err_state=rel_err(s1, s2))
        nbytes = 2 * state.numel() * 4
        drow["ours_us"] = [t * 1e3 for t in bench(lambda: da.kda_step(*xs, s1, use_qk_l2norm=True, backend="triton"))]
        drow["ours_TBps"] = nbytes / (drow["ours_us"][0] * 1e-6) / 1e12
        from triton.testing import do_bench_cudagraph
        try:
            drow["ours_graph_us"] = do_bench_cudagraph(lambda: da.kda_step(*xs, s1, use_qk_l2norm=True, backend="triton")) * 1e3
            drow["ours_graph_TBps"] = nbytes / (drow["ours_graph_us"] * 1e-6) / 1e12
        except Exception as e:  # noqa: BLE001
            drow["ours_graph_error"] = repr(e)[:300]
        print(json.dumps(drow))
    # per-kernel breakdown (B=8, T=4096)
    try:
        xs8 = inputs(8, 4096)
        q, k, v, g, beta = xs8
        sc = K ** -0.5
        _, _, chunk_t, ncmax = (None, None) + ti._index_tables(q.shape[0], q.shape[1], None, DEV)[1:]
        brk = {}
        brk["prep"] = bench(lambda: ti._prep(q, k, v, g, beta, None, None, sc, None, True, chunk_t))[0]
        brk["fwd_total"] = bench(lambda: ti.kda_fwd(q, k, v, g, beta, None, None, None, None, sc, None, True, False,
                                                    chunk=16))[0]
        if 64 in args.fwd_chunk and chunk_ok.get(64):
            chunk64_t = ti._index_tables(q.shape[0], q.shape[1], None, DEV, ti.BT64)[1]
            brk["prep64"] = bench(lambda: ti._prep64(q, k, v, g, beta, None, None, sc, None, True, chunk64_t))[0]
            brk["fwd64_total"] = bench(lambda: ti.kda_fwd(q, k, v, g, beta, None, None, None, None, sc, None, True,
                                                          False, chunk=64))[0]
        do8 = torch.randn_like(v)

        class _Skip:                    # a launcher stand-in: times the backward without its intra kernel
            def __getitem__(self, grid):
                return lambda *a, **kw: None
        for c in ([] if args.fwd_only else train_chunks):
            saved = ti.kda_fwd(q, k, v, g, beta, None, None, None, None, sc, None, True, False, True, chunk=c)[2]
            brk[f"fwd_store_states{c}"] = bench(lambda: ti.kda_fwd(q, k, v, g, beta, None, None, None, None, sc, None,
                                                                   True, False, True, chunk=c))[0]
            brk[f"bwd_total{c}"] = bench(lambda: ti.kda_bwd(q, k, v, g, beta, None, None, None, None, sc, None, True,
                                                            do8, None, saved))[0]
            name = "_kda_bwd_intra64_kernel" if c == 64 else "_kda_bwd_intra_kernel"
            real = getattr(ti, name)
            setattr(ti, name, _Skip())
            try:
                brk[f"bwd_scan_only{c}"] = bench(lambda: ti.kda_bwd(q, k, v, g, beta, None, None, None, None, sc, None,
                                                                    True, do8, None, saved))[0]
            finally:
                setattr(ti, name, real)
            brk[f"bwd_intra{c}"] = brk[f"bwd_total{c}"] - brk[f"bwd_scan_only{c}"]
            del saved
        print(json.dumps(dict(breakdown_8x4096_ms=brk)))
        rows.append(dict(breakdown_8x4096_ms=brk))
        del xs8, q, k, v, g, beta, do8
    except Exception as e:  # noqa: BLE001
        print("breakdown failed", repr(e)[:500])

    # ---------------------------------------------------------------------------------- FLA, same run
    if have_fla and not args.no_fla:
      try:
        if not args.fwd_only:
            from fla.ops.kda import fused_recurrent_kda
            s3 = state.clone()

            def fla_dec():
                return fused_recurrent_kda(*xs, initial_state=s3, output_final_state=True, use_qk_l2norm_in_kernel=True)
            of, _ = fla_dec()
            drow["fla_rel_err_o"] = rel_err(of, o2)
            s3.copy_(state)
            drow["fla_us"] = [t * 1e3 for t in bench(fla_dec)]
            drow["fla_TBps"] = nbytes / (drow["fla_us"][0] * 1e-6) / 1e12
            try:
                drow["fla_graph_us"] = do_bench_cudagraph(fla_dec) * 1e3
                drow["fla_graph_TBps"] = nbytes / (drow["fla_graph_us"] * 1e-6) / 1e12
            except Exception as e:  # noqa: BLE001
                drow["fla_graph_error"] = repr(e)[:300]
            drow["decode_speedup"] = drow["fla_us"][0] / drow["ours_us"][0]
            print(json.dumps(drow))
        shape_rows = [r for r in rows if "T" in r and "B" in r]
        for row in shape_rows:
            B, T = row["B"], row["T"]
            xs_ = inputs(B, T)
            o, g1 = keep[(B, T)]
            t0 = time.time()
            with torch.no_grad():
                of = fla_chunk(*xs_)
            row["fla_first_fwd_s"] = time.time() - t0
            row["fwd_rel_err_vs_fla"] = rel_err(o, of)
            with torch.no_grad():
                row["fla_fwd_ms"] = bench(lambda: fla_chunk(*xs_))
            if "ours_fwd_ms" in row:
                row["fwd_speedup"] = row["fla_fwd_ms"][0] / row["ours_fwd_ms"][0]
            for c in args.fwd_chunk:
                if f"ours_fwd{c}_ms" in row:
                    row[f"fwd{c}_speedup"] = row["fla_fwd_ms"][0] / row[f"ours_fwd{c}_ms"][0]
            print(json.dumps(row))
        for row in ([] if args.fwd_only else shape_rows):
            B, T = row["B"], row["T"]
            xs_ = inputs(B, T)
            do = torch.randn(B, T, H, V, device=DEV, dtype=torch.bfloat16)
            o, g1 = keep[(B, T)]
            t0 = time.time()
            g2 = grads(fla_chunk, xs_, do)
            row["fla_first_fwdbwd_s"] = time.time() - t0
            row["grad_rel_err_vs_fla"] = {n: rel_err(a, b) for n, a, b in zip("q k v g beta".split(), g1, g2)}
            del g2
            step, _ = fwd_bwd(fla_chunk, xs_, do)
            row["fla_fwdbwd_ms"] = bench(step)
            if "ours_fwdbwd_ms" in row:
                row["fwdbwd_speedup"] = row["fla_fwdbwd_ms"][0] / row["ours_fwdbwd_ms"][0]
            print(json.dumps(row))
      except Exception as e:  # noqa: BLE001
        print("FLA FAILED", repr(e)[:2000])
    rows.append(drow)
    del keep

    # ---------------------------------------------------------------------------------- crossover vs cuDNN
    if args.crossover:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for S in (1024, 4096, 16384, 65536, 131072):
            B = max(1, 65536 // S)
            row = dict(crossover_S=S, B=B)
            q = torch.randn(B, H, S, 128, device=DEV, dtype=torch.bfloat16)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                with torch.no_grad():
                    row["cudnn_fwd_ms"] = bench(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))[0]
                qq = q.detach().requires_grad_(True)
                dd = torch.randn_like(q)
                row["cudnn_fwdbwd_ms"] = bench(lambda: F.scaled_dot_product_attention(qq, qq, qq, is_causal=True).backward(dd))[0]
            del q, qq, dd
            xs = inputs(B, S)
            do = torch.randn(B, S, H, V, device=DEV, dtype=torch.bfloat16)
            with torch.no_grad():
                row["kda_fwd_ms"] = bench(lambda: ours(*xs))[0]
            step, _ = fwd_bwd(ours, xs, do)
            row["kda_fwdbwd_ms"] = bench(step)[0]
            print(json.dumps(row))
            rows.append(row)
            del xs, do
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------------------------- tuning variants
    if args.tune:
        def tune(var, res):
            step_var = bool(var) and "step" in next(iter(var))
            for B, T in ((8, 4096), (1, 32768)):
                if step_var:
                    continue
                xs = inputs(B, T)
                do = torch.randn(B, T, H, V, device=DEV, dtype=torch.bfloat16)
                with torch.no_grad():
                    res[f"fwd_{B}x{T}"] = bench(lambda: ours(*xs))[0]
                step, _ = fwd_bwd(ours, xs, do)
                res[f"fwdbwd_{B}x{T}"] = bench(step)[0]
            if not var or step_var:
                xs1 = [x[:, :1].contiguous() for x in inputs(Bd, 1)]
                res["decode_us"] = bench(lambda: da.kda_step(*xs1, s1, use_qk_l2norm=True, backend="triton"))[0] * 1e3
        config_sweep(ti, rows, "variant", [dict(prep_warps=4), dict(intra_warps=4), dict(bwd_min_programs=128),
                                           dict(min_programs=128), dict(scan_stages=2), dict(bwd_scan_warps=4),
                                           dict(step_bv=32), dict(step_warps=2), dict(save_intermediates=False)], tune)

    # ---------------------------------------------------------------------------------- 64-token variants
    if args.tune64:
        def tune64(var, res):
            for B, T in ((8, 4096), (1, 32768)):
                xs = inputs(B, T)
                with torch.no_grad():
                    o = ours(*xs)
                    ti.CONFIG["fwd_chunk"] = 16
                    res[f"rel_err_vs_fwd16_{B}x{T}"] = rel_err(o, ours(*xs))
                    ti.CONFIG["fwd_chunk"] = 64
                    res[f"fwd64_{B}x{T}"] = bench(lambda: ours(*xs))[0]
        config_sweep(ti, rows, "variant64", [dict(), dict(prep64_warps=4), dict(prep64_bk=16), dict(prep64_bk=64),
                                             dict(scan64_stages=3), dict(scan64_stages=1),
                                             dict(scan64_min_programs=512), dict(scan64_min_programs=128),
                                             dict(scan64_warps=4)], tune64, fwd_chunk=64)

    # ---------------------------------------------------------------------------------- 64-token training variants
    if args.tune_train64:
        def tune_train64(var, res):
            for B, T in ((8, 4096), (1, 32768)):
                xs = inputs(B, T)
                do = torch.randn(B, T, H, V, device=DEV, dtype=torch.bfloat16)
                step, _ = fwd_bwd(ours, xs, do)
                res[f"fwdbwd64_{B}x{T}"] = bench(step)[0]
        config_sweep(ti, rows, "train64_variant", [dict(), dict(intra64_warps=8),
                                                   dict(bwd_scan64_warps=4, bwd64_min_programs=128),
                                                   dict(intra64_bk=32)], tune_train64, train_chunk=64)

    with open(os.path.join(args.out, "kda_bench.json"), "w") as f:
        json.dump(dict(env=info, rows=rows), f, indent=1)
    # short table
    print("\n| shape | ours fwd ms | FLA fwd ms | x | ours fwd+bwd ms | FLA fwd+bwd ms | x |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "ours_fwd_ms" in r:
            print(f"| B={r['B']} T={r['T']} | {r['ours_fwd_ms'][0]:.3f} | {r.get('fla_fwd_ms', [float('nan')])[0]:.3f} | "
                  f"{r.get('fwd_speedup', float('nan')):.2f} | {r.get('ours_fwdbwd_ms', [float('nan')])[0]:.3f} | "
                  f"{r.get('fla_fwdbwd_ms', [float('nan')])[0]:.3f} | {r.get('fwdbwd_speedup', float('nan')):.2f} |")
        if "ours_fwd_ms" in r and len(args.fwd_chunk) > 1:
            print(f"| B={r['B']} T={r['T']} forward by chunk: " + ", ".join(
                f"{c}: {r[f'ours_fwd{c}_ms'][0]:.3f} ms ({r.get(f'fwd{c}_speedup', float('nan')):.2f}x FLA)"
                for c in args.fwd_chunk if f"ours_fwd{c}_ms" in r) + " |")
        if "ours_fwd_ms" in r and len(train_chunks) > 1:
            print(f"| B={r['B']} T={r['T']} fwd+bwd by training chunk: " + ", ".join(
                f"{c}: {r[f'ours_fwdbwd{c}_ms'][0]:.3f} ms" for c in train_chunks if f"ours_fwdbwd{c}_ms" in r) + " |")
        if "decode_B" in r and "ours_us" in r:
            print(f"decode B=64: ours {r['ours_us'][0]:.1f} us {r['ours_TBps']:.2f} TB/s; FLA "
                  f"{r.get('fla_us', [float('nan')])[0]:.1f} us {r.get('fla_TBps', float('nan')):.2f} TB/s")


if __name__ == "__main__":
    main()
