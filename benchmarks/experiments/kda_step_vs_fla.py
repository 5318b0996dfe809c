"""KDA decode step: da.kda_step (Gluon kernel on CUDA), the same call with the Triton kernel, and FLA's
fused_recurrent_kda (initial_state in, final state out, q/k L2-normed in the kernel), one token, H=16,
K=V=128, bf16 inputs, fp32 state; CUDA-graph replay with the L2 flushed; a graph-replayed copy_ of the state
bytes (read + written) for scale. Outputs of the three are compared before timing."""
import json, sys
import torch
import delta_attn as da
from delta_attn.ops.kda import launch as kp
from fla.ops.kda import fused_recurrent_kda
from steps_vs_copy_common import graph_ms

dev = torch.device("cuda")


def main():
    H, D = 16, 128
    rows = []
    for B in [int(a) for a in sys.argv[1:]] or [64, 256]:
        q, k, v = (torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        g = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, D, device=dev)).to(torch.bfloat16)
        beta = torch.rand(B, 1, H, device=dev, dtype=torch.bfloat16)
        state0 = torch.randn(B, H, D, D, device=dev) * 0.1
        state = state0.clone()
        o_ours = da.kda_step(q, k, v, g, beta, s1 := state0.clone(), use_qk_l2norm=True)
        saved = kp.gluon_available
        kp.gluon_available = lambda device: False
        o_tri = da.kda_step(q, k, v, g, beta, s2 := state0.clone(), use_qk_l2norm=True)
        kp.gluon_available = saved
        o_fla, s_fla = fused_recurrent_kda(q, k, v, g, beta, initial_state=state0.clone(), output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
        check = dict(triton_vs_gluon=(o_tri.float() - o_ours.float()).abs().max().item(),
                     state_triton_vs_gluon=(s2 - s1).abs().max().item(),
                     fla_vs_gluon=(o_fla.float() - o_ours.float()).abs().max().item(),
                     state_fla_vs_gluon=(s_fla.float() - s1).abs().max().item())
        print(json.dumps(dict(B=B, **check)), flush=True)
        nbytes = 2 * state.numel() * 4
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev); other = torch.empty_like(src)
        r = dict(B=B, copy_us=graph_ms(lambda: other.copy_(src)) * 1e3)
        r["gluon_us"] = graph_ms(lambda: da.kda_step(q, k, v, g, beta, state, use_qk_l2norm=True)) * 1e3
        kp.gluon_available = lambda device: False
        r["triton_us"] = graph_ms(lambda: da.kda_step(q, k, v, g, beta, state, use_qk_l2norm=True)) * 1e3
        kp.gluon_available = saved
        init = state0.clone()
        r["fla_us"] = graph_ms(lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)[0]) * 1e3
        rows.append(r); print(json.dumps(r), flush=True)
    print(f"{'B':>5s} {'copy us':>8s} {'gluon us':>9s} {'triton us':>9s} {'FLA us':>8s} {'copy/gluon':>10s} {'FLA/gluon':>9s}")
    for r in rows:
        print(f"{r['B']:5d} {r['copy_us']:8.2f} {r['gluon_us']:9.2f} {r['triton_us']:9.2f} {r['fla_us']:8.2f} "
              f"{r['copy_us'] / r['gluon_us']:10.3f} {r['fla_us'] / r['gluon_us']:9.3f}")


if __name__ == "__main__":
    main()
