"""KDA inference prefill, ``da.kda(backend="triton")`` under no_grad, against cuDNN frontend's native KDA, one
process (bf16, H = 16, K = V = 128).

python benchmarks/experiments/kda_prefill.py [--split] [--unchecked] [--sweep] [--shapes 64x1024,8x4096]
Prints one row per (shape, decay regime, config): ours ms, cuDNN-FE ms, ratio (cuDNN / ours), fraction of the
memory floor, and the max |ours - cuDNN| relative to max |o|. Configs: the shipped dispatch (the fused Gluon kernel
or the split kernels, ``launch.fused_forward_unsupported``); ``--split``: the split kernels forced; ``--unchecked``:
the shipped dispatch without the g <= 0 value check (DELTA_ATTN_SKIP_VALUE_CHECKS=1: no reduction, no host read);
``--sweep``: the split kernels' intra-chunk dots on tf32 operands; ``--intra-sweep``: their tiles. Each config's
output is compared with cuDNN-FE's (rel diff).
"""
import argparse
import dataclasses
import json
import os

import torch
import triton
import triton.language as tl

import delta_attn as da
from delta_attn.ops.kda import launch

SHAPES = [(8, 4096), (64, 1024), (16, 2048), (2, 16384), (1, 32768), (1, 131072)]
H, D = 16, 128


def inputs(B, T, regime, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = (r(B, T, H, D).bfloat16() for _ in range(3))
    shift = 4.0 if regime == "long" else 0.0
    g = torch.nn.functional.logsigmoid(r(B, T, H, D) + shift).float()
    beta = torch.rand(B, T, H, device="cuda", generator=gen).float()
    return q, k, v, g, beta


def copy_bandwidth():
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), rep=200)
    return 2 * x.numel() / (ms * 1e-3)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def cudnn_fn(q, k, v, g, beta):
    from cudnn.linear_attention import kimi_delta_attention
    B, T = q.shape[:2]
    cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * T
    qt, kt, vt = (x.reshape(B * T, H, D) for x in (q, k, v))
    gt, bt = g.reshape(B * T, H, D), beta.reshape(B * T, H)

    def fn():
        return kimi_delta_attention(qt, kt, vt, gt, bt, cu, use_qk_l2norm_in_kernel=True)
    return fn


def ours_fn(q, k, v, g, beta):
    def fn():
        with torch.no_grad():
            return da.kda(q, k, v, g, beta, use_qk_l2norm=True, backend="triton")[0]
    return fn


def _stats(q, v, num_seqs):
    """Registers, spills and shared memory of the forward kernel this call runs (the fused one in the form
    ``launch.fused_kernel`` picks, else the split intra-chunk one), as compiled last in this process ("-" where it
    has not compiled)."""
    if launch.fused_forward_unsupported(q, v, None, num_seqs) is None:
        kernel = launch.fused_kernel(num_seqs * v.shape[2], q.device)[0]
    else:
        kernel = launch._kda_infer_intra_kernel
    try:
        k = list(next(iter(kernel.device_caches.values()))[0].values())[-1]
    except (AttributeError, StopIteration, IndexError, TypeError):
        return "-"
    return dict(kernel=kernel.fn.__name__, regs=k.n_regs, spills=k.n_spills, smem=k.metadata.shared)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", action="store_true", help="also the split kernels (intra-chunk stage + scan), forced")
    ap.add_argument("--unchecked", action="store_true", help="also the shipped dispatch without the g value check")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--regimes", default="long,strong")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of ours (torch.profiler)")
    ap.add_argument("--intra-sweep", action="store_true",
                    help="the inference intra-chunk kernel's K slice (KS) x warps x chunk length, against the shipped")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()} copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for B, T in shapes:
        for regime in args.regimes.split(","):
            x = inputs(B, T, regime)
            nbytes = sum(t.numel() * t.element_size() for t in x) + x[2].numel() * 2
            floor_ms = nbytes / bw * 1e3
            o = ours_fn(*x)()
            if args.profile:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        ours_fn(*x)()
                    torch.cuda.synchronize()
                print(f"## profile {B}x{T} {regime} (5 calls)")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=40))
            ref = None
            try:
                ref = cudnn_fn(*x)()
                ref = ref[0] if isinstance(ref, tuple) else ref
                t_c = bench(cudnn_fn(*x))
            except Exception as e:  # noqa: BLE001
                print("cudnn failed", type(e).__name__, str(e)[:300])
                t_c = float("nan")
            configs = [None]
            if args.split:
                configs += ["split"]
            if args.unchecked:
                configs += ["unchecked"]
            if args.sweep:
                configs += ["tf32"]
            if args.intra_sweep:
                configs += [(ks, w, bt) for bt in (16, 32) for ks in (32, 64, 128) for w in (4, 8)]
            for cfg in configs:
                min_programs = launch.FUSED_MIN_PROGRAMS
                if cfg is not None and cfg != "unchecked":      # the split kernels' configs
                    launch.FUSED_MIN_PROGRAMS = 1 << 62
                if cfg == "unchecked":
                    os.environ["DELTA_ATTN_SKIP_VALUE_CHECKS"] = "1"
                if cfg == "tf32":      # the inference intra-chunk dots on fp32 operands in tf32
                    orig = launch.precision
                    launch.precision = lambda *a, **k: dataclasses.replace(orig(*a, **k), intra_op=tl.float32)
                elif isinstance(cfg, tuple):  # (KS, warps, chunk length) of the inference intra-chunk kernel
                    ks, w, bt_ = cfg
                    saved = launch.infer_intra_tiles, launch.infer_chunk
                    shipped = launch.infer_intra_tiles
                    launch.infer_intra_tiles = lambda K, V, bt, _s=shipped: tuple(
                        dataclasses.replace(t.with_(KS=min(ks, K)), num_warps=w) for t in _s(K, V, bt))
                    launch.infer_chunk = lambda *a, _bt=bt_: _bt
                diff = float("nan")
                stats = "-"
                try:
                    o = ours_fn(*x)()
                    if ref is not None:
                        diff = float((o.float() - ref.reshape(o.shape).float()).abs().max() / ref.float().abs().max())
                    t_o = bench(ours_fn(*x))
                    stats = _stats(x[0], x[2], B)
                except Exception as e:  # noqa: BLE001
                    t_o = float("nan")
                    print("ours failed", cfg, type(e).__name__, str(e)[:200])
                finally:
                    launch.FUSED_MIN_PROGRAMS = min_programs
                    os.environ.pop("DELTA_ATTN_SKIP_VALUE_CHECKS", None)
                    if cfg == "tf32":
                        launch.precision = orig
                    elif isinstance(cfg, tuple):
                        launch.infer_intra_tiles, launch.infer_chunk = saved
                row = dict(stats=stats, B=B, T=T, regime=regime, cfg=cfg, ours_ms=t_o, cudnn_ms=t_c, ratio=t_c / t_o,
                           floor_frac=floor_ms / t_o, rel_diff=diff)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if t_o != t_o:
                    break
    print("\n| B x T | decays | config | ours ms | cuDNN-FE ms | cuDNN/ours | floor frac | rel diff | stats |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']}x{r['T']} | {r['regime']} | {r['cfg']} | {r['ours_ms']:.3f} | {r['cudnn_ms']:.3f} | "
              f"{r['ratio']:.2f} | {r['floor_frac']:.2f} | {r['rel_diff']:.1e} | {r['stats']} |")


if __name__ == "__main__":
    main()
