"""Experiment (delete after measurement): launch configs of the decode step kernels, timed as CUDA-graph
replays on the bench decode shape (64 sequences, 16 heads, K = V = D = 128, bf16 inputs, fp32 state), against
a device-to-device copy of the same byte count replayed from a graph the same way.

Each candidate goes through :func:`delta_attn.bench.sweep.sweep` (correctness gate against the float64
reference first, a FAILED row gets no time; eager timing and graph replay by the suite's protocol, L2 flushed
before every timed call). Before the sweep, the speculative path ((B, T) ``state_indices`` with
``num_accepted_tokens``) of both kernels is checked against the reference backend at the same shape.

Printed per candidate: eager and graph-replay µs; the state traffic (fp32 state read + written) in TB/s;
``state/copy``: the time of a graph-replayed copy of the state byte count divided by the step's replay time
(the bar: >= 0.85 for KDA); ``all/copy``: the same with every byte of the call (inputs, output, state);
``vs ceiling``: the state TB/s over the bench's 1 GiB copy ceiling.

    PYTHONPATH=src python benchmarks/decode_step_sweep.py               # both kernels, every candidate
    PYTHONPATH=src python benchmarks/decode_step_sweep.py --op kda --quick
"""
from __future__ import annotations

import argparse

import torch

from delta_attn.bench.runner import Settings, measure_ceilings
from delta_attn.bench.sweep import sweep
from delta_attn.bench.timer import measure
from delta_attn.ops._launch import tiles
from delta_attn.ops.diag.triton_impl import diag_step
from delta_attn.ops.diag.triton_impl import step_tiles as diag_default
from delta_attn.ops.kda.pipeline import decode_step
from delta_attn.ops.kda.pipeline import step_tiles as kda_default

B, H, D = 64, 16, 128
DEV = torch.device("cuda")


def kda_configs(quick: bool):
    """BV x warps with 16 to 128 fp32 state elements per thread; streaming hints on the likely winners."""
    out = [kda_default(D, D)]
    pairs = [(32, 2), (64, 4), (32, 1)] if quick else [(bv, w) for bv in (16, 32, 64, 128) for w in (1, 2, 4, 8)
                                                       if 16 <= D * bv // (32 * w) <= 128]
    for bv, w in pairs:
        for stream in ((0, 1) if (bv, w) in ((32, 1), (32, 2), (64, 2), (64, 4), (16, 1)) else (0,)):
            c = tiles("sweep", num_warps=w, BV=bv, STREAM=stream)
            if c.meta != out[0].meta or c.num_warps != out[0].num_warps:
                out.append(c)
    return out


def diag_configs(quick: bool):
    """BD x warps with 1 to 16 fp32 channels per thread."""
    out = [diag_default(H * D)]
    pairs = [(512, 4), (256, 2), (1024, 8)] if quick else [(bd, w) for bd in (128, 256, 512, 1024, 2048)
                                                           for w in (1, 2, 4, 8) if 1 <= bd // (32 * w) <= 16]
    for bd, w in pairs:
        c = tiles("sweep", num_warps=w, BD=bd)
        if c.meta != out[0].meta or c.num_warps != out[0].num_warps:
            out.append(c)
    return out


def name(c) -> str:
    return " ".join(f"{k}={v}" for k, v in c.meta) + f" warps={c.num_warps}"


def graph_copy_ms(nbytes: int, settings: Settings) -> float:
    """A copy reading and writing ``nbytes`` in all (nbytes / 2 each way), replayed from a CUDA graph."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    return measure(graph.replay, DEV, warmup_ms=settings.warmup_ms, rep_ms=settings.rep_ms,
                   min_reps=settings.min_reps, max_reps=settings.max_reps).median_ms


def check_speculative() -> None:
    """Both kernels with (B, T) slot tables and accepted counts == the reference backend (fp32 arithmetic on
    the same bf16 inputs), at the sweep's shape with T = 4."""
    import delta_attn as da
    gen = torch.Generator(device=DEV).manual_seed(0)
    T, P = 4, 4 * B + 8
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)                      # noqa: E731
    table = torch.randperm(P, device=DEV, generator=gen)[:B * T].view(B, T).to(torch.int32)
    nat = torch.randint(1, T + 1, (B,), device=DEV, generator=gen, dtype=torch.int32)
    q, k, v = (r(B, T, H, D).bfloat16() for _ in range(3))
    g, beta = torch.nn.functional.logsigmoid(r(B, T, H, D) + 2).bfloat16(), torch.rand(B, T, H, device=DEV).bfloat16()
    pool = r(P, H, D, D) * 0.1
    p2 = pool.clone()
    o1 = da.kda_step(q, k, v, g, beta, pool, state_indices=table, num_accepted_tokens=nat, use_qk_l2norm=True,
                     backend="triton")
    o2 = da.kda_step(q, k, v, g, beta, p2, state_indices=table, num_accepted_tokens=nat, use_qk_l2norm=True,
                     backend="torch")
    torch.testing.assert_close(o1.float(), o2.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool, p2, atol=1e-4, rtol=1e-4)
    dpool = r(P, H, D)
    d2 = dpool.clone()
    o1 = da.gated_diag_step(q, k, v, -g.float().abs().bfloat16(), dpool, state_indices=table, num_accepted_tokens=nat,
                            backend="triton")
    o2 = da.gated_diag_step(q, k, v, -g.float().abs().bfloat16(), d2, state_indices=table, num_accepted_tokens=nat,
                            backend="torch")
    torch.testing.assert_close(o1.float(), o2.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dpool, d2, atol=1e-4, rtol=1e-4)
    print("speculative check (B, T) slots + num_accepted_tokens: kda_step and gated_diag_step match the reference")


def run(op: str, configs, settings: Settings, ceilings) -> None:
    if op == "kda":
        case = dict(op="kda_decode", B=B, H=H, D=D)
        cands = {name(c): (lambda c: lambda q, k, v, g, beta, state: decode_step(
            q, k, v, g, beta, state, None, None, None, D ** -0.5, None, True, config=c))(c) for c in configs}
        state_bytes = 2 * B * H * D * D * 4
    else:
        case = dict(op="diag_decode", B=B, H=H, D=D)
        cands = {name(c): (lambda c: lambda q, k, v, g, state: diag_step(q, k, v, g, state, config=c))(c)
                 for c in configs}
        state_bytes = 2 * B * H * D * 4
    rows = sweep(case, cands, settings, ceilings=ceilings)
    all_bytes = next((r["bytes"] for r in rows if r.get("bytes")), state_bytes)
    copy_state, copy_all = graph_copy_ms(state_bytes, settings), graph_copy_ms(all_bytes, settings)
    copy_tbs = ceilings.get("copy_gbps", float("nan")) / 1e3
    print(f"\n{op} step, B={B} H={H} D={D} bf16, fp32 state: state traffic {state_bytes / 1e6:.2f} MB, all "
          f"{all_bytes / 1e6:.2f} MB; graph-replayed copy of the same bytes: {copy_state * 1e3:.2f} / "
          f"{copy_all * 1e3:.2f} µs; copy ceiling (1 GiB) {copy_tbs:.2f} TB/s; default: {name(configs[0])}")
    print(f"{'config':36s} {'status':7s} {'eager µs':>9s} {'graph µs':>9s} {'state TB/s':>10s} {'state/copy':>10s} "
          f"{'all/copy':>9s} {'vs ceiling':>10s}")
    key = lambda r: r.get("graph_ms") or r.get("ms") or float("inf")          # noqa: E731
    for r in sorted(rows, key=key):
        if r["status"] != "ok":
            print(f"{r['impl']:36s} {r['status']:7s} {r.get('note', '')[:120]}")
            continue
        ms = r.get("graph_ms") or r["ms"]
        tbs = state_bytes / (ms / 1e3) / 1e12
        print(f"{r['impl']:36s} {'ok':7s} {r['ms'] * 1e3:9.2f} {ms * 1e3:9.2f} {tbs:10.2f} {copy_state / ms:10.3f} "
              f"{copy_all / ms:9.3f} {tbs / copy_tbs:10.3f}" + ("" if r.get("graph_ms") else "  (no graph: "
                                                                 + r.get("graph_note", "")[:80] + ")"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=("kda", "diag", "both"), default="both")
    ap.add_argument("--quick", action="store_true", help="three candidates per kernel besides the default")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    settings = Settings(device="cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    check_speculative()
    ceilings = measure_ceilings(DEV, settings)
    if a.op in ("kda", "both"):
        run("kda", kda_configs(a.quick), settings, ceilings)
    if a.op in ("diag", "both"):
        run("diag", diag_configs(a.quick), settings, ceilings)


if __name__ == "__main__":
    main()
