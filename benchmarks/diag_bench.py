#!/usr/bin/env python
"""Gated diagonal attention on one GPU: effective bandwidth against the card's copy bandwidth,
with flash-linear-attention's element-wise recurrences (``chunk_hgrn``, ``fused_recurrent_hgrn``)
measured beside it in the same process.

Byte model (minimal traffic; each tensor of B*T*H*D elements moved once, at its dtype's size):
  forward          read q, k, v, g; write o                                   -> 5 tensors
  forward+backward forward (5) + backward: read q, k, v, g, do;
                   write dq, dk, dv, dg                                       -> 5 + 9 = 14 tensors
The kernels' own extra traffic (a tile-carry workspace of 8 bytes per channel per BT tokens, the
look-back reads, one g row re-read per tile in the backward) is real but not counted: the byte
model is the ideal, so the fraction is a fraction of the best any kernel could do.
Copy bandwidth: ``dst.copy_(src)`` of 2 GiB, bytes read + written, measured at the start of the run.

FLA's hgrn computes ``h_t = exp(g_t) h_{t-1} + x_t, o_t = h_t`` on (B, T, W); we map our op at the
same width W = H*D with ``x = k * v`` (precomputed, not timed) and the same log decay g. hgrn does
less work than ours (it reads 2 tensors and writes 1; there is no q): its times are compared as
times, and its own effective bandwidth is given with its own byte model (fwd: x, g read, o written
= 3 tensors; fwd+bwd: 3 + read g, o, do and write dx, dg = 8 tensors).

Usage: PYTHONPATH=src python benchmarks/diag_bench.py [--sweep | --rows-ab] [--crossover] [--out DIR]
(--rows-ab: a short sweep of the default kernels against the opt-in rows variants, same process;
Timing: CUDA events, L2 flushed (256 MB memset) before every repeat, median and [p20, p80].
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from delta_attn.ops.diag import triton_impl as ti  # noqa: E402
from delta_attn.ops.diag.scan_ref import gated_diag_scan  # noqa: E402
from delta_attn.testing import check  # noqa: E402

SHAPES = [(8, 4096), (1, 32768), (1, 1 << 20)]
H, D = 16, 128
DT = torch.bfloat16
_flush = None


def bench(fn, budget_ms=400.0, max_reps=50):
    """Median, p20, p80 in ms over repeats with L2 flushed before each."""
    global _flush
    if _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    reps = int(max(3, min(max_reps, budget_ms / max(est, 1e-3))))
    ts = []
    for _ in range(reps):
        _flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in ts)
    pick = lambda f: ms[min(len(ms) - 1, int(f * len(ms)))]
    return pick(0.5), pick(0.2), pick(0.8)


def copy_bandwidth():
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    med, lo, hi = bench(lambda: dst.copy_(src), max_reps=30)
    del src, dst
    return 2 * (1 << 31) / (med * 1e-3) / 1e12


def env():
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()}
    import triton
    info["triton"] = triton.__version__
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        info["driver"] = "?"
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=os.path.dirname(__file__)).stdout.strip() or "?"
    except OSError:
        info["git"] = "?"
    try:
        import fla
        info["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        info["fla"] = f"missing ({type(e).__name__})"
    return info


def inputs(b, t, seed=0):
    g_ = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, t, H, D, device="cuda", dtype=DT, generator=g_) for _ in range(3))
    g = (-torch.rand(b, t, H, D, device="cuda", generator=g_) * 0.1).to(DT)
    do = torch.randn(b, t, H, D, device="cuda", dtype=DT, generator=g_)
    return q, k, v, g, do


def correct(q, k, v, g, do, fcfg=None, bcfg=None, grads=True):
    """Gate before timing: head 0 of the full run against the float64 scan (error rule, float32
    scan as baseline); grads=False checks the forward alone. Returns a list of failures (empty = correct)."""
    o, _, ws = ti.diag_fwd(q, k, v, g, config=fcfg, training=grads)
    dq = dk = dv = dg = None
    if grads:
        dq, dk, dv, dg, _ = ti.diag_bwd(q, k, v, g, do, ws, config=bcfg,
                                        fwd_bt=(fcfg or ti.TRAIN_FWD_CONFIG).segment_rows)
    sl = lambda x: x[:, :, :1].contiguous()
    o64, _, g64 = gated_diag_scan(*(sl(x) for x in (q, k, v, g)), do=sl(do))
    o32, _, g32 = gated_diag_scan(*(sl(x) for x in (q, k, v, g)), do=sl(do), dtype=torch.float32)
    bad = []
    outs = [o, dq, dk, dv, dg] if grads else [o]
    for name, x, r64, r32, kind in zip(["o", "dq", "dk", "dv", "dg"], outs,
                                       [o64, *g64[:4]], [o32, *g32[:4]], ["fwd"] + ["grad"] * 4):
        v_ = check(sl(x), r64, r32.to(x.dtype), kind=kind, name=name)
        if not v_.ok:
            bad.append(v_.message)
    del o, ws, dq, dk, dv, dg, o64, g64, o32, g32
    return bad


def fla_rows(b, t, q, k, v, g, do, fused=True):
    try:
        from fla.ops.hgrn import chunk_hgrn, fused_recurrent_hgrn
    except Exception as e:  # noqa: BLE001
        return {"chunk_hgrn": f"missing: {e}", "fused_recurrent_hgrn": f"missing: {e}"}
    w = H * D
    x = (k.float() * v.float()).to(DT).reshape(b, t, w).requires_grad_()
    gg = g.reshape(b, t, w).clone().requires_grad_()
    dox = do.reshape(b, t, w)
    out = {}
    for name, fn in (("chunk_hgrn", chunk_hgrn), ("fused_recurrent_hgrn", fused_recurrent_hgrn)):
        if name == "fused_recurrent_hgrn" and not fused:
            out[name] = "skipped (--fused-max-t)"
            continue
        try:
            with torch.no_grad():
                f = bench(lambda: fn(x, gg), budget_ms=300)

            def fb():
                o, _ = fn(x, gg)
                torch.autograd.grad(o, (x, gg), dox)
            fbt = bench(fb, budget_ms=300)
            out[name] = {"fwd_ms": f, "fwdbwd_ms": fbt}
        except Exception as e:  # noqa: BLE001
            out[name] = f"failed: {type(e).__name__}: {e}"[:300]
    del x, gg
    return out


C = ti.DiagConfig
# (bt, bd, w, warps, early); ptxas register counts and SASS instruction counts (sm_90a) in the results
# file. The backward's tile must be a multiple of the forward's; the sweep runs the backward on 8-row
# forward carries.
FWD_SWEEP = [C(32, 32, 8, 1), C(32, 32, 4, 1), C(64, 32, 8, 2), C(16, 64, 4, 1), C(16, 64, 8, 1),
             C(8, 128, 4, 1), C(16, 32, 4, 1), C(32, 16, 4, 1)]
# the opt-in "rows" forward (_diag_fwd_rows_kernel: no cross-thread scan; bd spans H * D); sm_90a
# registers / SASS instructions per 1024 elements in the results file ("Next measurement")
R = lambda bt, bd, w, warps, hold: C(bt, bd, w, warps, kind="rows", hold=hold)   # noqa: E731
E = lambda bt, bd, w, warps: C(bt, bd, w, warps, True, kind="rows", hold=True)          # noqa: E731  (q early)
ROWS_SWEEP = [R(16, 64, 8, 1, True), E(16, 64, 8, 1), E(16, 64, 4, 1), E(16, 64, 2, 1), E(16, 128, 8, 2),
              E(16, 128, 4, 2), E(32, 64, 4, 1), R(16, 64, 2, 1, True), R(64, 64, 8, 1, False)]
BWD_SWEEP = [C(32, 32, 8, 1), C(32, 32, 4, 1), C(16, 64, 4, 1), C(16, 64, 8, 1), C(8, 128, 4, 1),
             C(32, 16, 4, 1), C(16, 32, 4, 1), C(32, 64, 4, 2)]
ROWS_BWD_SWEEP = [C(16, 64, 8, 1, kind="rows"), C(16, 64, 4, 1, kind="rows"), C(16, 64, 2, 1, kind="rows"),
                  C(32, 64, 8, 1, kind="rows"), C(16, 128, 8, 2, kind="rows"), C(16, 128, 4, 2, kind="rows"),
                  C(16, 128, 2, 2, kind="rows"), C(16, 256, 4, 4, kind="rows")]
TILE_BWD = [C(32, 32, 8, 1)]   # the tile backward (the default before the rows pair)
# rows forwards with split tiles (`split` segments of bt / split rows walked side by side, their maps
# combined once per tile): long tiles, so few tiles of a chain in flight, at a short tile's registers;
# sm_90a registers in the results file (`diag_sass.py --split-only`)
S = lambda bt, bd, w, warps, split: C(bt, bd, w, warps, True, kind="rows", hold=True, split=split)  # noqa: E731
SPLIT_SWEEP = [S(64, 64, 8, 4, 4), S(64, 64, 4, 4, 4), S(64, 64, 16, 4, 4), S(128, 64, 8, 4, 4),
               S(128, 32, 8, 4, 4), S(64, 32, 8, 2, 2), C(64, 64, 8, 4, kind="rows", hold=True, split=4)]


def _short(r):
    c = r.get("cfg")
    name = (f"{r['kind']} {c.kind}{'+hold' if c.hold else ''} {c.bt}x{c.bd} w{c.w} {c.warps}wp "
            f"{'early' if c.early else 'late'}{f' split{c.split}' if c.split > 1 else ''}" if c else r["kind"])
    if "error" in r:
        return f"{name}: ERROR {r['error']}"
    frac = r.get("frac", r.get("frac_of_9"))
    return f"{name}: {r['ms']:.3f} ms {100 * frac:.1f}% copy ok={r['ok']}"


def sweep_configs(bw, rec, fwd_sweep=None, bwd_sweep=None):
    """Time every candidate on (B=1, T=32768) (the packed layout makes (8, 4096) the same work),
    each checked against the float64 scan first; returns the fastest correct fwd / bwd pair."""
    fwd_sweep = FWD_SWEEP + ROWS_SWEEP if fwd_sweep is None else fwd_sweep
    bwd_sweep = BWD_SWEEP + ROWS_BWD_SWEEP if bwd_sweep is None else bwd_sweep
    b, t = 1, 32768
    q, k, v, g, do = inputs(b, t, seed=1)
    elems = b * t * H * D
    sl = lambda x: x[:, :, :1].contiguous()
    o64, _, g64 = gated_diag_scan(*(sl(x) for x in (q, k, v, g)), do=sl(do))
    o32, _, g32 = gated_diag_scan(*(sl(x) for x in (q, k, v, g)), do=sl(do), dtype=torch.float32)
    fwd, bwd = [], []
    for cfg in fwd_sweep:
        try:
            v_ = check(sl(ti.diag_fwd(q, k, v, g, config=cfg)[0]), o64, o32.to(DT))
            ms = bench(lambda: ti.diag_fwd(q, k, v, g, config=cfg), budget_ms=120)[0]
            r = {"kind": "fwd", "cfg": cfg, "ms": ms, "frac": elems * 10 / (ms * 1e-3) / 1e12 / bw, "ok": v_.ok}
            if v_.ok:
                fwd.append((ms, cfg))
        except Exception as e:  # noqa: BLE001
            r = {"kind": "fwd", "cfg": cfg, "error": f"{type(e).__name__}: {e}"[:200]}
        rec.append(r)
        print("sweep", _short(r))
    f8 = C(8, 64, 4, 1)
    _, _, ws8 = ti.diag_fwd(q, k, v, g, config=f8)
    for cfg in bwd_sweep:
        try:
            grads = ti.diag_bwd(q, k, v, g, do, ws8, config=cfg, fwd_bt=8)
            oks = [check(sl(x), r64, r32.to(x.dtype), kind="grad").ok for x, r64, r32 in zip(grads[:4], g64, g32)]
            ms = bench(lambda: ti.diag_bwd(q, k, v, g, do, ws8, config=cfg, fwd_bt=8), budget_ms=120)[0]
            r = {"kind": "bwd", "cfg": cfg, "ms": ms, "frac_of_9": elems * 18 / (ms * 1e-3) / 1e12 / bw,
                 "ok": all(oks)}
            if all(oks):
                bwd.append((ms, cfg))
        except Exception as e:  # noqa: BLE001
            r = {"kind": "bwd", "cfg": cfg, "error": f"{type(e).__name__}: {e}"[:200]}
        rec.append(r)
        print("sweep", _short(r))
    best_f = min(fwd, key=lambda x: x[0])[1] if fwd else ti.FWD_CONFIG
    pairs = [(tf + tb, cf, cb) for tf, cf in fwd for tb, cb in bwd if cb.bt % cf.segment_rows == 0]
    pair = min(pairs, key=lambda x: x[0])[1:] if pairs else (ti.TRAIN_FWD_CONFIG, ti.BWD_CONFIG)
    # diagnostics: the same kernels without the look-back (wrong results: streaming cost only)
    ti._lookback = False
    try:
        d_f = bench(lambda: ti.diag_fwd(q, k, v, g, config=best_f), budget_ms=120)[0]
        d_b = bench(lambda: ti.diag_bwd(q, k, v, g, do, ws8, config=pair[1], fwd_bt=8), budget_ms=120)[0]
        rec.append({"kind": "diagnostic_no_lookback", "fwd_ms": d_f, "bwd_ms": d_b,
                    "fwd_cfg": best_f, "bwd_cfg": pair[1]})
        print("sweep", rec[-1])
    finally:
        ti._lookback = True
    del q, k, v, g, do, ws8
    torch.cuda.empty_cache()
    return best_f, pair


def decode():
    """One decode step for 64 sequences (H = 16, D = 128, fp32 state pool), ours through the public API
    (validation and dispatch included) against FLA's fused_recurrent_hgrn (x = k v, width H * D)."""
    import delta_attn as da
    b = 64
    q, k, v, g, _ = inputs(b, 1)
    state = torch.randn(b, H, D, device="cuda")
    idx = torch.arange(b, device="cuda", dtype=torch.int32)
    ours = bench(lambda: da.gated_diag_step(q, k, v, g, state, backend="triton"))
    print(f"gated_diag_step (ours, API, no indices): {ours[0] * 1e3:.1f} us [{ours[1] * 1e3:.1f}, {ours[2] * 1e3:.1f}]")
    for skip in ("0", "1"):
        # state_indices are checked on the host (one device-to-host copy) unless DELTA_ATTN_SKIP_VALUE_CHECKS=1
        os.environ["DELTA_ATTN_SKIP_VALUE_CHECKS"] = skip
        r = bench(lambda: da.gated_diag_step(q, k, v, g, state, state_indices=idx, backend="triton"))
        print(f"gated_diag_step (ours, API, state_indices, DELTA_ATTN_SKIP_VALUE_CHECKS={skip}): "
              f"{r[0] * 1e3:.1f} us [{r[1] * 1e3:.1f}, {r[2] * 1e3:.1f}]")
    os.environ.pop("DELTA_ATTN_SKIP_VALUE_CHECKS")
    try:
        from fla.ops.hgrn import fused_recurrent_hgrn
        x = (k * v).reshape(b, 1, H * D)
        gg = g.reshape(b, 1, H * D)
        s0 = state.reshape(b, H * D)
        fla = bench(lambda: fused_recurrent_hgrn(x, gg, initial_state=s0, output_final_state=True))
        print(f"FLA fused_recurrent_hgrn: {fla[0] * 1e3:.1f} us [{fla[1] * 1e3:.1f}, {fla[2] * 1e3:.1f}]; "
              f"ours / FLA = {ours[0] / fla[0]:.2f}")
    except Exception as e:  # noqa: BLE001
        print(f"FLA fused_recurrent_hgrn: not run ({type(e).__name__}: {e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time tile configs first and use the fastest")
    ap.add_argument("--rows-ab", action="store_true",
                    help="short sweep: the default kernels and the rows variants (same process)")
    ap.add_argument("--split-ab", action="store_true",
                    help="forward only: the default forwards against the split-tile rows forwards (same process)")
    ap.add_argument("--decode", action="store_true",
                    help="only the decode step: gated_diag_step against FLA fused_recurrent_hgrn (B = 64, one token)")
    ap.add_argument("--crossover", action="store_true", help="cuDNN causal attention at 64K tokens per batch")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fused-max-t", type=int, default=1 << 30, help="skip fused_recurrent_hgrn above this T")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.decode:
        return decode()
    info = env()
    print(json.dumps(info))
    bw = copy_bandwidth()
    info["copy_TBps"] = bw
    print(f"device-to-device copy: {bw:.3f} TB/s (read + written)")
    sweep = []
    fcfg, (pf, pb) = ti.FWD_CONFIG, (ti.TRAIN_FWD_CONFIG, ti.BWD_CONFIG)
    if a.sweep:
        fcfg, (pf, pb) = sweep_configs(bw, sweep)
    elif a.split_ab:
        fcfg, _ = sweep_configs(bw, sweep, [ti.FWD_CONFIG, ti.TRAIN_FWD_CONFIG] + SPLIT_SWEEP, [])
    elif a.rows_ab:
        fcfg, (pf, pb) = sweep_configs(bw, sweep, [ti.FWD_CONFIG] + ROWS_SWEEP, TILE_BWD + ROWS_BWD_SWEEP)
    info["fwd_config"], info["train_configs"] = str(fcfg), (str(pf), str(pb))
    print(f"forward config: {fcfg}\ntraining pair: fwd {pf} / bwd {pb}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "diag_tuned.json"), "w") as fh:
            json.dump({"fwd": pf.__dict__, "bwd": pb.__dict__, "fwd_inference": fcfg.__dict__}, fh)
    rows = []
    for b, t in SHAPES:
        q, k, v, g, do = inputs(b, t)
        elems = b * t * H * D
        fwd_bytes = elems * 2 * 5
        fb_bytes = elems * 2 * 14
        row = {"B": b, "T": t, "H": H, "D": D}
        bad = correct(q, k, v, g, do, pf, pb)
        if fcfg != pf:
            bad += correct(q, k, v, g, do, fcfg, grads=False)
        row["correct"] = bad or "ok"
        if bad:
            print(f"B={b} T={t}: FAILED {bad}")
        else:
            f = bench(lambda: ti.diag_fwd(q, k, v, g, config=fcfg))

            def fwdbwd():
                _, _, w_ = ti.diag_fwd(q, k, v, g, config=pf, training=True)
                ti.diag_bwd(q, k, v, g, do, w_, config=pb, fwd_bt=pf.segment_rows)
            fb = bench(fwdbwd)
            row.update(fwd_ms=f, fwdbwd_ms=fb,
                       fwd_TBps=fwd_bytes / (f[0] * 1e-3) / 1e12, fwdbwd_TBps=fb_bytes / (fb[0] * 1e-3) / 1e12)
            row["fwd_frac"] = row["fwd_TBps"] / bw
            row["fwdbwd_frac"] = row["fwdbwd_TBps"] / bw
            print(f"B={b} T={t}: fwd {f[0]:.3f} ms [{f[1]:.3f}, {f[2]:.3f}] {row['fwd_TBps']:.2f} TB/s "
                  f"({100 * row['fwd_frac']:.0f}% of copy); fwd+bwd {fb[0]:.3f} ms [{fb[1]:.3f}, {fb[2]:.3f}] "
                  f"{row['fwdbwd_TBps']:.2f} TB/s ({100 * row['fwdbwd_frac']:.0f}%)")
        if not a.no_fla:
            row["fla"] = fla_rows(b, t, q, k, v, g, do, fused=t <= a.fused_max_t)
            for name, r in row["fla"].items():
                if isinstance(r, dict):
                    print(f"  {name}: fwd {r['fwd_ms'][0]:.3f} ms ({3 * elems * 2 / (r['fwd_ms'][0] * 1e-3) / 1e12:.2f}"
                          f" TB/s own model), fwd+bwd {r['fwdbwd_ms'][0]:.3f} ms "
                          f"({8 * elems * 2 / (r['fwdbwd_ms'][0] * 1e-3) / 1e12:.2f} TB/s own model)")
                else:
                    print(f"  {name}: {r}")
        rows.append(row)
        del q, k, v, g, do
        torch.cuda.empty_cache()
    print("\n| B | T | fwd ms | fwd TB/s | % copy | fwd+bwd ms | fwd+bwd TB/s | % copy | chunk_hgrn fwd / fwd+bwd ms | fused_recurrent_hgrn fwd / fwd+bwd ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["correct"] != "ok":
            print(f"| {r['B']} | {r['T']} | FAILED | | | | | | | |")
            continue
        fl = r.get("fla", {})
        cell = lambda n: (f"{fl[n]['fwd_ms'][0]:.3f} / {fl[n]['fwdbwd_ms'][0]:.3f}"
                          if isinstance(fl.get(n), dict) else str(fl.get(n, "not run"))[:40])
        print(f"| {r['B']} | {r['T']} | {r['fwd_ms'][0]:.3f} | {r['fwd_TBps']:.2f} | {100 * r['fwd_frac']:.0f}% | "
              f"{r['fwdbwd_ms'][0]:.3f} | {r['fwdbwd_TBps']:.2f} | {100 * r['fwdbwd_frac']:.0f}% | "
              f"{cell('chunk_hgrn')} | {cell('fused_recurrent_hgrn')} |")
    cross = []
    if a.crossover:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
        for s_ in (1024, 4096, 16384, 65536):
            b = 65536 // s_
            qa, ka, va = (torch.randn(b, H, s_, D, device="cuda", dtype=DT, requires_grad=True) for _ in range(3))
            doa = torch.randn_like(qa)
            r = {"S": s_, "B": b}
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    with torch.no_grad():
                        r["cudnn_fwd"] = bench(lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True))[0]
                    r["cudnn_fwdbwd"] = bench(lambda: torch.autograd.grad(
                        F.scaled_dot_product_attention(qa, ka, va, is_causal=True), (qa, ka, va), doa))[0]
            except Exception as e:  # noqa: BLE001
                r["cudnn"] = f"failed: {e}"[:200]
            del qa, ka, va, doa
            q, k, v, g, do = inputs(b, s_)
            r["diag_fwd"] = bench(lambda: ti.diag_fwd(q, k, v, g, config=fcfg))[0]

            def fwdbwd():
                _, _, w_ = ti.diag_fwd(q, k, v, g, config=pf, training=True)
                ti.diag_bwd(q, k, v, g, do, w_, config=pb, fwd_bt=pf.segment_rows)
            r["diag_fwdbwd"] = bench(fwdbwd)[0]
            del q, k, v, g, do
            cross.append(r)
            print("crossover", r)
    if a.out:
        with open(os.path.join(a.out, "diag_bench.json"), "w") as fh:
            json.dump({"env": info, "rows": rows, "sweep": sweep, "crossover": cross}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
