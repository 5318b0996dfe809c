"""Experiment (delete after measurement): launch configs of ``flash_attn_with_kvcache``'s Triton split-KV
attention kernel at the issue's shape (B=64, cache 8K, Hq=32, Hk=8, D=128, one new token, bf16), contiguous and
paged (256-token pages), timed as CUDA-graph replays, against SDPA's cuDNN kernel on the same contiguous cache
(cuDNN-frontend paged on the paged one) and a graph-replayed copy of the cache's byte count (the ceiling).

A candidate is ``num_splits`` x the launcher's explicit ``config`` (:func:`delta_attn.ops.flash.decode.kvcache_fwd`):
``BLOCK_N`` keys per tile, warps, stages, and ``HOIST`` (0: the old kernel, every tile masked; 1: only the tiles
at the edges of the visible range are masked). The first candidate is the current default (HOIST=0, 64 keys,
4 warps, 3 stages, splits chosen from the shapes). Each candidate is first checked against the float64
reference on two sequences of the batch (DESIGN.md's error rule; a failing one gets no time), then timed by
``delta_attn.bench.timer.measure`` on graph replays (L2 flushed before each). One call = append + attention
(+ merge when split), as the peers' rows (they append too).

Printed, per layout, sorted by time: µs per step, the cache read (2.15 GB: K and V) in TB/s, ``frac copy``
(that rate over the copy's: the issue's bar is >= 0.80) and ``vs cuDNN`` (cuDNN's time / ours: bar >= 1.0);
then the best config per layout. A copy goes to $OUT/kvcache_sweep.txt when OUT is set.

    PYTHONPATH=src python benchmarks/kvcache_sweep.py              # both layouts, ~35 candidates each
    PYTHONPATH=src python benchmarks/kvcache_sweep.py --quick      # 8 candidates each
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from delta_attn import reference
from delta_attn.bench import cases, impls
from delta_attn.bench.timer import measure
from delta_attn.ops._launch import tiles
from delta_attn.ops.flash import decode
from delta_attn.ops.flash.kvcache import validate
from delta_attn.testing import check

DEV = torch.device("cuda")
SHAPE = dict(op="kvcache_decode", B=64, ctx=8192, H=32, Hk=8, D=128)
CACHE_BYTES = 2 * SHAPE["B"] * SHAPE["ctx"] * SHAPE["Hk"] * SHAPE["D"] * 2        # K and V, bf16
CHECKED = 2                                                                      # sequences checked in float64
TIMER = dict(warmup_ms=10.0, rep_ms=40.0, min_reps=10, max_reps=50)


def cfg(block_n: int, warps: int, stages: int, hoist: int):
    return tiles("sweep", num_warps=warps, num_stages=stages, BLOCK_N=block_n, HOIST=hoist)


def candidates(quick: bool):
    """(num_splits, config) pairs; None = the default (splits from the shapes, the default tiles)."""
    out = [(0, None), (2, cfg(64, 4, 3, 0)), (4, cfg(64, 4, 3, 0))]
    if quick:
        return out + [(s, cfg(bn, w, st, 1)) for s, bn, w, st in
                      ((1, 64, 4, 3), (2, 64, 4, 3), (4, 64, 4, 3), (2, 128, 4, 2), (4, 128, 8, 2))]
    hoisted = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2)]
    out += [(s, cfg(bn, w, st, 1)) for bn, w, st in hoisted for s in (1, 2, 4, 8)]
    out += [(s, cfg(bn, w, st, 1)) for bn, w, st in ((64, 4, 3), (128, 4, 2)) for s in (3, 6)]
    return out


def name(splits: int, c) -> str:
    if c is None:
        return "default (splits from shapes)"
    m = dict(c.meta)
    return f"splits={splits} BN={m['BLOCK_N']} w={c.num_warps} st={c.num_stages} hoist={m['HOIST']}"


def graph_ms(call, context=None) -> float:
    """``call`` captured once in a CUDA graph (warmed on a side stream first), median of timed replays."""
    import contextlib
    ctx = context or contextlib.nullcontext
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with ctx(), torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with ctx(), torch.cuda.graph(g):
        call()
    g.replay()
    torch.cuda.synchronize()
    return measure(g.replay, DEV, **TIMER).median_ms


def copy_ms(nbytes: int) -> float:
    """A device copy moving ``nbytes`` in all (nbytes / 2 read, nbytes / 2 written), graph-replayed."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    return graph_ms(lambda: dst.copy_(src))


def reference_subset(t):
    """(ref64, ref in bf16) of the first CHECKED sequences, over the cache after the step's append."""
    ctx, q = SHAPE["ctx"], t["q"][:CHECKED]
    kc, vc = t["k_cache"], t["v_cache"]
    if "block_table" in t:
        rows = t["block_table"][:CHECKED].long()
        kc, vc = kc[rows].flatten(1, 2), vc[rows].flatten(1, 2)
    else:
        kc, vc = kc[:CHECKED], vc[:CHECKED]
    kc, vc = kc[:, :ctx], vc[:, :ctx]
    r64 = reference.attention(q.double(), kc.double(), vc.double(), causal=True)[0]
    rlp = reference.attention(q, kc, vc, causal=True, upcast=False)[0]
    return r64, rlp


def run_layout(page: int, quick: bool, deadline: float, lines: list) -> None:
    case = dict(SHAPE, page=page)
    t = cases.make_inputs(case, DEV, torch.bfloat16, seed=0)
    layout = f"paged {page}" if page else "contiguous"
    rows = []
    ref = None

    def kw(splits):
        return dict(cache_seqlens=t["cache_seqlens"], block_table=t.get("block_table"), causal=True,
                    num_splits=splits)

    for splits, c in candidates(quick):
        label = name(splits, c)
        if time.perf_counter() > deadline:
            rows.append((label, None, "skipped: the script's time budget ended"))
            continue
        a = validate(t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], **kw(splits))
        call = lambda a=a, c=c: decode.kvcache(a, config=c)                   # noqa: E731
        try:
            out = call()[0]
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a config that does not compile / fit is a row
            rows.append((label, None, f"{type(e).__name__}: {str(e)[:100]}"))
            continue
        if ref is None:
            ref = reference_subset(t)                                          # after the first append
        v = check(out[:CHECKED], *ref, name="out")
        if not v.ok:
            rows.append((label, None, "FAILED " + v.message))
            continue
        rows.append((label, graph_ms(call), ""))
    peers = []
    if page == 0:
        for label in ("cuDNN (SDPA)", "FA2 (SDPA flash)"):
            peers.append((label, impls._sdpa_kvcache_bind(label)(case, t)))
    elif impls._cudnn_paged_why_not(case, DEV, torch.bfloat16, False) is None:
        peers.append(("cuDNN paged (cudnn-frontend)", impls._cudnn_paged_bind(case, t)))
    peer_ms = {}
    for label, b in peers:
        try:
            with b.context():
                out = b.fn()
            v = check(out[:CHECKED], *ref, name="out") if ref is not None else None
            if v is not None and not v.ok:
                rows.append((label, None, "FAILED " + v.message))
                continue
            peer_ms[label] = graph_ms(b.fn, b.context)
            rows.append((label, peer_ms[label], "peer"))
        except Exception as e:  # noqa: BLE001
            rows.append((label, None, f"{type(e).__name__}: {str(e)[:100]}"))
    cp = copy_ms(CACHE_BYTES)
    copy_tbs = CACHE_BYTES / (cp / 1e3) / 1e12
    cudnn = peer_ms.get("cuDNN (SDPA)") or peer_ms.get("cuDNN paged (cudnn-frontend)")
    first = len(lines)
    lines.append(f"\n{layout}: B={SHAPE['B']} ctx={SHAPE['ctx']} Hq={SHAPE['H']} Hk={SHAPE['Hk']} D={SHAPE['D']} bf16, "
                 f"cache read {CACHE_BYTES / 1e9:.2f} GB; graph-replayed copy of {CACHE_BYTES / 1e9:.2f} GB: "
                 f"{cp * 1e3:.1f} µs = {copy_tbs:.2f} TB/s" + (f"; cuDNN {cudnn * 1e3:.1f} µs" if cudnn else ""))
    lines.append(f"{'candidate':48s} {'µs':>8s} {'TB/s':>6s} {'frac copy':>9s} {'vs cuDNN':>8s}  note")
    for label, ms, note in sorted(rows, key=lambda r: r[1] if r[1] is not None else float("inf")):
        if ms is None:
            lines.append(f"{label:48s} {'-':>8s} {'':6s} {'':9s} {'':8s}  {note}")
            continue
        tbs = CACHE_BYTES / (ms / 1e3) / 1e12
        vs = f"{cudnn / ms:8.3f}" if cudnn else f"{'':8s}"
        lines.append(f"{label:48s} {ms * 1e3:8.1f} {tbs:6.2f} {tbs / copy_tbs:9.3f} {vs}  {note}")
    ours = [r for r in rows if r[1] is not None and r[2] != "peer"]
    if ours:
        best = min(ours, key=lambda r: r[1])
        lines.append(f"best {layout}: {best[0]}  {best[1] * 1e3:.1f} µs, "
                     f"{CACHE_BYTES / (best[1] / 1e3) / 1e12 / copy_tbs:.3f} of copy"
                     + (f", {cudnn / best[1]:.3f}x cuDNN" if cudnn else ""))
    print("\n".join(lines[first:]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 candidates per layout")
    ap.add_argument("--layout", choices=("contiguous", "paged", "both"), default="both")
    ap.add_argument("--budget-s", type=float, default=140.0, help="candidates not started by then are skipped")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    t0 = time.perf_counter()
    lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__}"]
    print(lines[0], flush=True)
    pages = {"contiguous": [0], "paged": [256], "both": [0, 256]}[a.layout]
    for i, page in enumerate(pages):
        # the budget shared between the layouts; the peers and the copy run even past it
        share = t0 + a.budget_s * (i + 1) / len(pages)
        run_layout(page, a.quick, share, lines)
        torch.cuda.empty_cache()
    lines.append(f"\ntotal {time.perf_counter() - t0:.0f} s")
    print(lines[-1])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kvcache_sweep.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
