"""KDA decode step launch sweep with the token inputs issued up front (decode.py at this tree).

H=16, K=V=128, bf16 inputs, fp32 state, T=1, use_qk_l2norm. Per B: a graph-replayed copy_ of the same bytes
(state read + written), da.kda_step (shipped config), and BV {16, 32, 64} x warps {1, 2, 4} through
decode_step(config=...), each checked against da.kda_step on a fresh state first; one row with (B,) state_indices
(a shuffled pool twice the size). CUDA-graph replay, L2 flushed (bench.timer.measure).
"""
import json, sys
import torch
import delta_attn as da
from delta_attn.ops._launch import tiles
from delta_attn.ops.kda import pipeline as kp
from steps_vs_copy_common import graph_ms

dev = torch.device("cuda")


def main():
    H, D = 16, 128
    rows = []
    for B in [int(a) for a in sys.argv[1:]] or [64, 256, 1024, 4096]:
        q, k, v = (torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, D, device=dev)).to(torch.bfloat16)
        beta = torch.rand(B, 1, H, device=dev, dtype=torch.bfloat16)
        state0 = torch.randn(B, H, D, D, device=dev) * 0.1
        state = state0.clone()
        nbytes = 2 * state.numel() * 4
        s_ref = state0.clone()
        o_ref = da.kda_step(q, k, v, g, beta, s_ref, use_qk_l2norm=True)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev); other = torch.empty_like(src)
        copy_us = graph_ms(lambda: other.copy_(src)) * 1e3

        def add(name, fn, check=True):
            if check:
                state.copy_(state0)
                o = fn()
                err = max((o.float() - o_ref.float()).abs().max().item(), (state - s_ref).abs().max().item())
                assert err < 2e-2, (name, err)
            us = graph_ms(fn) * 1e3
            r = dict(B=B, cfg=name, us=us, copy_us=copy_us, copy_over_step=copy_us / us, TBps=nbytes / us / 1e6)
            rows.append(r); print(json.dumps(r), flush=True)

        add("shipped", lambda: da.kda_step(q, k, v, g, beta, state, use_qk_l2norm=True))
        for BV in (16, 32, 64):
            for w in (1, 2, 4):
                t = tiles("sweep", BV=BV, num_warps=w)
                try:
                    add(f"BV{BV} w{w}", lambda t=t: kp.decode_step(q, k, v, g, beta, state, None, None, None, D ** -0.5,
                                                                  None, True, None, t))
                except Exception as e:  # noqa: BLE001
                    print(json.dumps(dict(B=B, cfg=f"BV{BV} w{w}", error=str(e)[:200])), flush=True)
        pool = torch.randn(2 * B, H, D, D, device=dev) * 0.1
        idx = torch.randperm(2 * B, device=dev)[:B].to(torch.int32)
        add("shipped, (B,) state_indices", lambda: da.kda_step(q, k, v, g, beta, pool, state_indices=idx,
                                                               use_qk_l2norm=True), check=False)
        del pool, state, state0, s_ref, src, other
        torch.cuda.empty_cache()
    print(f"{'B':>5s} {'config':30s} {'us':>8s} {'copy us':>8s} {'copy/step':>9s}")
    for r in rows:
        print(f"{r['B']:5d} {r['cfg']:30s} {r['us']:8.2f} {r['copy_us']:8.2f} {r['copy_over_step']:9.3f}")


if __name__ == "__main__":
    main()
