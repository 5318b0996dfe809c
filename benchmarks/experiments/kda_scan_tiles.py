"""Experiment: the Gluon training scans' launch, V blocks of 64 in one warpgroup (two programs per chain, the
previous tiles: a two-stage ring when the programs are no more than the SMs, else one stage) against the whole V in
two warpgroups (one program per chain, the shipped tiles, two stages or one). A training step (``da.kda`` forward
and backward, q / k pre-normalised, fp32 g and beta, long decays, the g check off), bf16, H = 16, K = V = 128;
``triton.testing.do_bench`` medians; every output and gradient against the first option's (max |difference|).
Prints | B x T | scan tiles | step ms | max diff |.

python benchmarks/experiments/kda_scan_tiles.py [--shapes 8x4096,64x1024,16x2048,1x32768]
"""
import argparse
import functools
import os

import torch
import triton

import delta_attn as da
from delta_attn.ops._launch import sm_count, tiles
from delta_attn.ops.kda import launch as L

H, D = 16, 128


def options(chains: int, device):
    blocks = tiles("V blocks of 64", num_warps=4, BV=64, NW=4, STAGES=2 if 2 * chains <= sm_count(device) else 1)
    whole2, whole1 = L.scan_fused_tiles()
    return [("V blocks of 64, one warpgroup", (blocks,)), ("whole V, two warpgroups, 2 stages", (whole2,)),
            ("whole V, two warpgroups, 1 stage", (whole1,))]


def step(q, k, v, g, beta, do):
    for t in (q, k, v, g, beta):
        t.grad = None
    o = da.kda(q, k, v, g, beta, backend="triton")[0]
    o.backward(do)
    return [o] + [t.grad for t in (q, k, v, g, beta)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x4096,64x1024,16x2048,1x32768")
    args = ap.parse_args()
    os.environ["DELTA_ATTN_SKIP_VALUE_CHECKS"] = "1"
    shipped = L.scan_fused_tiles
    for B, T in [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16() for _ in range(3))
        q = torch.nn.functional.normalize(q.float(), dim=-1).bfloat16().requires_grad_()
        k = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16().requires_grad_()
        v.requires_grad_()
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, device="cuda", generator=gen) + 4).requires_grad_()
        beta = torch.rand(B, T, H, device="cuda", generator=gen).requires_grad_()
        do = torch.randn_like(v)
        ref = None
        for name, cand in options(B * H, q.device):
            L.scan_fused_tiles = lambda cand=cand: cand
            out = [t.float() for t in step(q, k, v, g, beta, do)]
            ref = out if ref is None else ref
            diff = max((a - b).abs().max().item() for a, b in zip(out, ref))
            t = triton.testing.do_bench(functools.partial(step, q, k, v, g, beta, do), warmup=10, rep=200,
                                        return_mode="median")
            print(f"| {B} x {T} | {name} | {t:.3f} | {diff:.1e} |", flush=True)
        L.scan_fused_tiles = shipped
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
