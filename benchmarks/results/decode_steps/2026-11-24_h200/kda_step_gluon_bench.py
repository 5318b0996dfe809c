"""Times kda_step_gluon.py's layouts against da.kda_step and a same-size copy (H=16, K=V=128, bf16, fp32 state,
T=1, use_qk_l2norm, no slots; CUDA-graph replay, L2 flushed). Each variant is checked against da.kda_step first."""
import json, sys
import torch
import delta_attn as da
from steps_vs_copy_common import graph_ms
import kda_step_gluon as G

dev = torch.device("cuda")


def main():
    H, D = 16, 128
    rows = []
    for B in [int(a) for a in sys.argv[1:]] or [64, 256, 1024]:
        q, k, v = (torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, D, device=dev)).to(torch.bfloat16)
        beta = torch.rand(B, 1, H, device=dev, dtype=torch.bfloat16)
        state0 = torch.randn(B, H, D, D, device=dev) * 0.1
        state = state0.clone()
        s_ref = state0.clone()
        o_ref = da.kda_step(q, k, v, g, beta, s_ref, use_qk_l2norm=True)
        nbytes = 2 * state.numel() * 4
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev); other = torch.empty_like(src)
        copy_us = graph_ms(lambda: other.copy_(src)) * 1e3

        def add(name, fn):
            try:
                state.copy_(state0)
                o = fn()
                err = max((o.float() - o_ref.float()).abs().max().item(), (state - s_ref).abs().max().item())
                assert err < 2e-2, f"err {err}"
                us = graph_ms(fn) * 1e3
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(B=B, cfg=name, error=str(e)[:400])), flush=True); return
            r = dict(B=B, cfg=name, us=us, copy_us=copy_us, copy_over_step=copy_us / us, err=err)
            rows.append(r); print(json.dumps(r), flush=True)

        add("shipped (Triton)", lambda: da.kda_step(q, k, v, g, beta, state, use_qk_l2norm=True))
        for name, BV, W, L in G.layouts():
            def run(BV=BV, W=W, L=L):
                o = torch.empty_like(v)
                G.kda_step_gluon[(D // BV, B, H)](q, k, v, g, beta, state, o, D ** -0.5, H, H, K=D, V=D, BV=BV, L=L,
                                                  num_warps=W)
                return o
            add("gluon " + name, run)
        del state, state0, s_ref, src, other
        torch.cuda.empty_cache()
    print(f"{'B':>5s} {'config':44s} {'us':>8s} {'copy us':>8s} {'copy/step':>9s}")
    for r in rows:
        print(f"{r['B']:5d} {r['cfg'][:44]:44s} {r['us']:8.2f} {r['copy_us']:8.2f} {r['copy_over_step']:9.3f}")


if __name__ == "__main__":
    main()
