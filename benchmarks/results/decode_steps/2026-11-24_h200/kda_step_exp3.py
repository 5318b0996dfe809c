"""KDA decode step at B = 64: register cap (maxnreg), a T = 1 specialisation, and the persistent variants of
kda_step_persistent.py, against a graph-replayed copy_ of the same bytes (experiment, not shipped).

H=16, K=V=128, bf16 inputs, fp32 state, T=1, use_qk_l2norm, no state_indices. Each variant is checked against
da.kda_step on a fresh state, then timed as a CUDA-graph replay with the L2 flushed.
"""
import json, sys
import torch, triton, triton.language as tl
import delta_attn as da
from delta_attn.ops._launch import optional
from delta_attn.ops.diag.kernels import _ld, _st
from delta_attn.ops.kda.decode import _kda_step_kernel, _kda_step_token
from steps_vs_copy_common import graph_ms
import kda_step_persistent as KP

dev = torch.device("cuda")


@triton.jit
def _kda_step_t1(q, k, v, g, beta, S, O, scale, H, HV, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """The shipped kernel for one token, no slots, raw gate: no loop (T constexpr 1)."""
    iv = tl.program_id(0)
    bi = tl.program_id(1).to(tl.int64)
    hv = tl.program_id(2).to(tl.int64)
    h = hv // (HV // H)
    kk = tl.arange(0, K)
    vv = iv * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    ms = mk[:, None] & mv[None, :]
    in_slot = (hv * K + kk[:, None]) * V + vv[None, :]
    s_start = S + bi * (HV * K * V) + in_slot
    st = _ld(s_start, ms, True)
    st = _kda_step_token(q, k, v, g, beta, S, S, O, st, 1.0, tl.zeros([K], tl.float32), bi, hv, h, 0, kk, mk, vv,
                         mv, ms, in_slot, scale, 0.0, 1, H, HV, K, V, True, 0, 0, True)
    _st(s_start, st, ms, True)


def main():
    H, D = 16, 128
    rows = []
    for B in [int(a) for a in sys.argv[1:]] or [64, 256]:
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
        ph = optional(None, q)

        def add(name, fn):
            try:
                state.copy_(state0)
                o = fn()
                err = max((o.float() - o_ref.float()).abs().max().item(), (state - s_ref).abs().max().item())
                assert err < 2e-2, f"err {err}"
                us = graph_ms(fn) * 1e3
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(B=B, cfg=name, error=str(e)[:300])), flush=True); return
            r = dict(B=B, cfg=name, us=us, copy_us=copy_us, copy_over_step=copy_us / us)
            rows.append(r); print(json.dumps(r), flush=True)

        add("shipped", lambda: da.kda_step(q, k, v, g, beta, state, use_qk_l2norm=True))
        for BV, w in ((64, 4), (32, 2), (16, 1), (32, 4)):
            for cap in (None, 128):
                opt = {} if cap is None else dict(maxnreg=cap)

                def run(BV=BV, w=w, opt=opt):
                    o = torch.empty_like(v)
                    _kda_step_kernel[(D // BV, B, H)](q, k, v, g, beta, ph, ph, state, ph, ph, o, D ** -0.5, 0.0, 1, H,
                                                      H, K=D, V=D, KP=D, BV=BV, L2NORM=True, GATE=0,
                                                      HAS_DT_BIAS=False, IDX=0, HAS_NAT=False, EVEN=True,
                                                      num_warps=w, **opt)
                    return o

                def run1(BV=BV, w=w, opt=opt):
                    o = torch.empty_like(v)
                    _kda_step_t1[(D // BV, B, H)](q, k, v, g, beta, state, o, D ** -0.5, H, H, K=D, V=D, BV=BV,
                                                  num_warps=w, **opt)
                    return o
                add(f"BV{BV} w{w} maxnreg={cap}", run)
                add(f"T1 BV{BV} w{w} maxnreg={cap}", run1)
        for var in (KP.Variant(per_sm="occ", pipe="auto", stages=3, BV=32, warps=2),
                    KP.Variant(per_sm="occ", pipe="manual", BV=32, warps=2),
                    KP.Variant(per_sm="occ", pipe="auto", stages=2)):
            add(f"persistent {var}", lambda var=var: KP.persistent_step(q, k, v, g, beta, state, None, None, None,
                                                                       D ** -0.5, None, True, None, var))
        del state, state0, s_ref, src, other
        torch.cuda.empty_cache()
    print(f"{'B':>5s} {'config':58s} {'us':>8s} {'copy us':>8s} {'copy/step':>9s}")
    for r in rows:
        print(f"{r['B']:5d} {r['cfg'][:58]:58s} {r['us']:8.2f} {r['copy_us']:8.2f} {r['copy_over_step']:9.3f}")


if __name__ == "__main__":
    main()
