"""Experiment: how long one 64-token chunk takes in the training forward's two kernels when a program has its SM
alone against two sharing it (the question behind a fused training forward: does a builder alone on its SM keep
the intra-chunk kernel's throughput?). bf16, H = 16, K = V = 128, 8 x 4096 inputs, long decays; each kernel
launched on the first P programs' chunks (``triton.testing.do_bench`` medians, us). Prints
| kernel | programs | us | us per chunk per program |.

python benchmarks/experiments/kda_train_chunk_latency.py
"""
import functools

import torch
import triton

from delta_attn.ops._launch import sm_count
from delta_attn.ops.kda import launch as L

B, T, H, D = 8, 4096, 16, 128


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16() for _ in range(3))
    q = torch.nn.functional.normalize(q.float(), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, device="cuda", generator=gen) + 4)
    beta = torch.rand(B, T, H, device="cuda", generator=gen)
    prec = L.precision(q.dtype, False, D, True)
    bt = L.TRAIN_CHUNK
    ch = L.chunk_tables(B, T, None, q.device, bt)
    NC = ch.chunk_t.shape[0]
    W, QG, KD, U, AQK, GC, TM = L._operands(q, v, NC, bt, prec.work, True)
    flags = torch.empty(NC, H, dtype=torch.int32, device=q.device)
    o = torch.empty_like(v)
    HS = torch.empty(NC, H, D, D, dtype=prec.work, device=q.device)
    VNEW = torch.empty(B * T, H, D, dtype=prec.work, device=q.device)
    sms = sm_count(q.device)

    def intra(P):          # P programs: the first P // H chunks, every head
        c = P // H
        L.launch(L._kda_train_intra_fused_kernel, lambda t: (c, H),
                 (q, k, v, g, beta, ch.chunk_t[:c], W, U, QG, KD, AQK, GC[:c], TM, flags[:c], D ** -0.5, H, H),
                 dict(K=D, V=D, BT=bt, BK=L.FUSED_INTRA_BK, BC=L.FUSED_INTRA_BC, L2NORM=False, FLOOR=L.DECAY_FLOOR,
                      FACTOR_MAX=L.FACTOR_MAX, NW=L.FUSED_INTRA_WARPS, GBITS=32), (L.INTRA_FUSED_TILES,))

    def scan(P, stages):   # P programs of the shipped tiles: P // H sequences, every head
        n = P // H
        cand = tuple(t.with_(STAGES=stages) for t in L.scan_fused_tiles()[:1])
        L.launch(L._kda_fwd_scan_fused_kernel, lambda t: (D // t.get("BV"), n, H),
                 (W, U, QG, KD, AQK, GC, q, ch.seq_t[:n], o, VNEW, HS, q, H),
                 dict(K=D, V=D, BT=bt, USE_H0=False, STORE_FINAL=False, STORE_H=True), cand)

    intra(NC * H)
    for P in (sms // 2, sms, 2 * sms, 4 * sms, 8 * sms, NC * H):
        P = P // H * H
        t = triton.testing.do_bench(functools.partial(intra, P), warmup=25, rep=200, return_mode="median") * 1e3
        waves = -(-P // (2 * sms))
        print(f"| intra-chunk | {P} | {t:.1f} | {t / waves:.1f} per wave of 2 per SM |", flush=True)
    nchunks = T // bt
    for stages in (1, 2):
        for P in (64, 128, 256):
            run = functools.partial(scan, P, stages)
            t = triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median") * 1e3
            print(f"| scan, {stages} stage(s) | {P} | {t:.1f} | {t / nchunks:.2f} per chunk |", flush=True)


if __name__ == "__main__":
    main()
