"""gated_diag_step launch configs (BD channels per program x warps) against a copy of all the step's bytes
(q, k, v, g read, o written: bf16; state read + written: fp32), graph replays with L2 flushed."""
import json, sys
import torch
import delta_attn as da
from delta_attn.bench.timer import measure
from delta_attn.ops._launch import tiles
from delta_attn.ops.diag import launch as ti
from steps_vs_copy_common import graph_ms, ceiling_tbps

dev = torch.device("cuda")
H, D = 16, 128
ceiling = ceiling_tbps()
rows = []
for B in (64, 256, 1024, 4096, 16384):
    q, k, v = (torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, 1, H, D, device=dev)).to(torch.bfloat16)
    state = torch.randn(B, H, D, device=dev)
    all_bytes = 5 * q.numel() * 2 + 2 * state.numel() * 4
    src = torch.empty(all_bytes // 2, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
    copy_ms = graph_ms(lambda: dst.copy_(src))
    ref_state = state.clone(); ref_o = da.gated_diag_step(q, k, v, g, ref_state)
    for bd in (128, 256, 512, 1024, 2048, 4096):
        for w in (1, 2, 4, 8, 16):
            if bd // (32 * w) < 1 or bd // (32 * w) > 16:
                continue
            cfg = tiles("sweep", num_warps=w, BD=bd)
            s2 = state.clone()
            o = ti.diag_step(q, k, v, g, s2, config=cfg)
            err = max(float((o.float() - ref_o.float()).abs().max()), float((s2 - ref_state).abs().max()))
            ms = graph_ms(lambda: ti.diag_step(q, k, v, g, state, config=cfg))
            r = dict(B=B, BD=bd, warps=w, us=ms * 1e3, copy_us=copy_ms * 1e3, of_ceiling=all_bytes / ms / 1e9 / ceiling,
                     copy_of_ceiling=all_bytes / copy_ms / 1e9 / ceiling, err=err)
            rows.append(r); print(json.dumps(r), flush=True)
print(f"ceiling {ceiling:.3f} TB/s")
for B in sorted({r['B'] for r in rows}):
    rs = sorted([r for r in rows if r['B'] == B], key=lambda r: r['us'])
    for r in rs[:4]:
        print(f"B={B:6d} BD={r['BD']:5d} w={r['warps']:2d} {r['us']:8.2f} us  copy {r['copy_us']:8.2f} us  "
              f"step {r['of_ceiling']:.3f} copy {r['copy_of_ceiling']:.3f} of ceiling  err {r['err']:.1e}")
    d = [r for r in rs if r['BD'] == 128 and r['warps'] == 4][0]
    print(f"B={B:6d} shipped BD=128 w=4 {d['us']:8.2f} us  step {d['of_ceiling']:.3f}")
