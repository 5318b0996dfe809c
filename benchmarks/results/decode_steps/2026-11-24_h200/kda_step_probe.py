"""KDA decode step at small B: where does the time go? (experiment, not shipped)

Variants at H=16, K=V=128, bf16 inputs, fp32 state, T=1, use_qk_l2norm, no state_indices (as steps_vs_copy.py):
  shipped      da.kda_step
  step o/e     the shipped kernel's token step with grid order o (0: (iv, b, hv) as shipped; 1: (iv, hv, b), i.e.
               programs walk the pool linearly) and eviction hints e (0 none; 1 state load evict_first + store .cs)
  tile o       load the same state tile and store it back scaled (the step's memory pattern without arithmetic)
  memcpy       graph-replayed copy_ of the same bytes;  inplace: state.mul_(c) (torch elementwise, same bytes)
Every step variant is checked against da.kda_step first. Prints JSON lines and a table.
"""
import json, sys
import torch, triton, triton.language as tl
import delta_attn as da
from delta_attn.ops.kda.decode import _kda_step_token
from steps_vs_copy_common import graph_ms

dev = torch.device("cuda")


@triton.jit
def _step_probe(q, k, v, g, beta, S, O, scale, B, H, HV, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                ORDER: tl.constexpr, EVICT: tl.constexpr):
    iv = tl.program_id(0)
    if ORDER == 0:
        bi = tl.program_id(1).to(tl.int64); hv = tl.program_id(2).to(tl.int64)
    else:
        hv = tl.program_id(1).to(tl.int64); bi = tl.program_id(2).to(tl.int64)
    h = hv // (HV // H)
    kk = tl.arange(0, K)
    vv = iv * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    ms = mk[:, None] & mv[None, :]
    in_slot = (hv * K + kk[:, None]) * V + vv[None, :]
    ptr = S + bi * (HV * K * V) + in_slot
    if EVICT:
        st = tl.load(ptr, eviction_policy="evict_first")
    else:
        st = tl.load(ptr)
    st = _kda_step_token(q, k, v, g, beta, S, S, O, st, 1.0, tl.zeros([K], tl.float32), bi, hv, h, 0, kk, mk, vv,
                         mv, ms, in_slot, scale, 0.0, 1, H, HV, K, V, True, 0, 0, True)
    if EVICT:
        tl.store(ptr, st, cache_modifier=".cs")
    else:
        tl.store(ptr, st)


@triton.jit
def _tile_probe(S, HV, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, ORDER: tl.constexpr):
    iv = tl.program_id(0)
    if ORDER == 0:
        bi = tl.program_id(1).to(tl.int64); hv = tl.program_id(2).to(tl.int64)
    else:
        hv = tl.program_id(1).to(tl.int64); bi = tl.program_id(2).to(tl.int64)
    kk = tl.arange(0, K)
    vv = iv * BV + tl.arange(0, BV)
    ptr = S + bi * (HV * K * V) + (hv * K + kk[:, None]) * V + vv[None, :]
    tl.store(ptr, tl.load(ptr) * 0.999)


def main():
    H, D = 16, 128
    rows = []
    for B in [int(a) for a in sys.argv[1:]] or [64, 256]:
        q, k = (torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16)
        g = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, D, device=dev)).to(torch.bfloat16)
        beta = torch.rand(B, 1, H, device=dev, dtype=torch.bfloat16)
        state0 = torch.randn(B, H, D, D, device=dev) * 0.1
        state = state0.clone()
        nbytes = 2 * state.numel() * 4
        o_ref = da.kda_step(q, k, v, g, beta, s_ref := state0.clone(), use_qk_l2norm=True)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev); other = torch.empty_like(src)

        def add(name, fn, check=None):
            try:
                if check is not None:
                    err = check()
                    assert err < 1e-3, f"{name}: err {err}"
                ms = graph_ms(fn)
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(B=B, name=name, error=str(e)[:300])), flush=True); return
            r = dict(B=B, name=name, us=ms * 1e3, TBps=nbytes / ms / 1e9)
            rows.append(r); print(json.dumps(r), flush=True)

        add("memcpy", lambda: other.copy_(src))
        add("inplace mul_", lambda: state.mul_(0.999))
        add("shipped", lambda: da.kda_step(q, k, v, g, beta, state, use_qk_l2norm=True))
        for BV, warps in ((64, 4), (32, 2), (128, 8), (128, 4), (64, 8), (32, 4)):
            for order in (0, 1):
                grid = (triton.cdiv(D, BV), B, H) if order == 0 else (triton.cdiv(D, BV), H, B)
                add(f"tile o{order} BV{BV} w{warps}", lambda grid=grid, BV=BV, order=order:
                    _tile_probe[grid](state, H, K=D, V=D, BV=BV, ORDER=order, num_warps=warps))
                for ev in (0, 1):
                    o = torch.empty_like(v)
                    run = lambda grid=grid, BV=BV, order=order, ev=ev, o=o: _step_probe[grid](
                        q, k, v, g, beta, state, o, D ** -0.5, B, H, H, K=D, V=D, BV=BV, ORDER=order, EVICT=ev,
                        num_warps=warps)
                    def check(run=run, o=o):
                        state.copy_(state0); run()
                        return max((o.float() - o_ref.float()).abs().max().item(), (state - s_ref).abs().max().item())
                    add(f"step o{order} e{ev} BV{BV} w{warps}", run, check)
    print(f"{'B':>5s} {'variant':28s} {'us':>8s} {'TB/s':>6s} {'memcpy/x':>8s}")
    base = {r['B']: r['us'] for r in rows if r['name'] == 'memcpy'}
    for r in rows:
        print(f"{r['B']:5d} {r['name']:28s} {r['us']:8.2f} {r['TBps']:6.3f} {base[r['B']] / r['us']:8.3f}")


if __name__ == "__main__":
    main()
