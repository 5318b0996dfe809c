"""Decode steps against a copy of the same state bytes, both as CUDA-graph replays, L2 flushed before each
replay (bench.timer.measure). KDA: H=16, K=V=128; diagonal: H=16, D=128; bf16 inputs, fp32 state, one token.
Prints one JSON line per row and a table last."""
import json, sys
import torch
import delta_attn as da
from steps_vs_copy_common import ceiling_tbps, graph_ms
from delta_attn.ops.kda import launch as kp

dev = torch.device("cuda")
H, D = 16, 128


ceiling = ceiling_tbps()
rows = []
SWEEP = "--no-sweep" not in sys.argv
configs = {"kda": [None] + ([dict(BV=bv, num_warps=w) for bv in (16, 32, 64) for w in (1, 2, 4, 8)] if SWEEP else [])}
for B in [int(x) for x in (a for a in sys.argv[1:] if not a.startswith("--"))] or [64, 256, 1024, 4096]:
    for op in ("kda", "diag"):
        if op == "kda":
            q, k = (torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
            v = torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16)
            g = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, D, device=dev)).to(torch.bfloat16)
            beta = torch.rand(B, 1, H, device=dev, dtype=torch.bfloat16)
            state = torch.randn(B, H, D, D, device=dev) * 0.1
        else:
            q, k, v = (torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
            g = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, D, device=dev)).to(torch.bfloat16)
            state = torch.randn(B, H, D, device=dev)
        nbytes = 2 * state.numel() * 4
        if op == "diag":        # every byte the step moves: q, k, v, g read and o written (bf16), the state (fp32)
            nbytes += 5 * q.numel() * 2
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)      # a copy moving the same bytes
        other = torch.empty_like(src)
        copy_ms = graph_ms(lambda: other.copy_(src))
        cfgs = configs.get(op, [None]) if B in (64, 256) else [None]
        for cfg in cfgs:
            if op == "kda":
                if cfg is None:
                    fn = lambda: da.kda_step(q, k, v, g, beta, state, use_qk_l2norm=True)
                else:
                    t = kp.tiles("sweep", **cfg)
                    fn = lambda t=t: kp.decode_step(q, k, v, g, beta, state, None, None, None, D ** -0.5, None,
                                                   True, None, t)
            else:
                fn = lambda: da.gated_diag_step(q, k, v, g, state)
            try:
                ms = graph_ms(fn)
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(op=op, B=B, cfg=str(cfg), error=str(e)[:200])), flush=True)
                continue
            r = dict(op=op, B=B, cfg=str(cfg or "default"), us=ms * 1e3, copy_us=copy_ms * 1e3, state_MB=nbytes / 2 / 1e6,
                     TBps=nbytes / ms / 1e9, of_ceiling=nbytes / ms / 1e9 / ceiling, copy_over_step=copy_ms / ms,
                     copy_of_ceiling=nbytes / copy_ms / 1e9 / ceiling)
            rows.append(r)
            print(json.dumps(r), flush=True)
print(f"copy ceiling (1 GiB copy_, read+write): {ceiling:.3f} TB/s")
print(f"{'op':5s} {'B':>5s} {'cfg':34s} {'us':>8s} {'copy us':>8s} {'TB/s':>6s} {'of ceil':>7s} {'copy/step':>9s} {'copy of ceil':>12s}")
for r in rows:
    print(f"{r['op']:5s} {r['B']:5d} {r['cfg'][:34]:34s} {r['us']:8.2f} {r['copy_us']:8.2f} {r['TBps']:6.3f} {r['of_ceiling']:7.3f} {r['copy_over_step']:9.3f} {r['copy_of_ceiling']:12.3f}")
