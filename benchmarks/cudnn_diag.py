"""Quick facts about cudnn-frontend on this machine (used for docs/DISPATCH.md): does it import
without nvidia-cutlass-dsl / apache-tvm-ffi, and which left-bound convention matches our window.

    PYTHONPATH=src python benchmarks/cudnn_diag.py
"""
import importlib.util
import time

import torch

import delta_attn as da
from delta_attn import reference

for mod in ("cutlass", "tvm_ffi", "cuda", "cudnn"):
    print(f"module {mod}: {'present' if importlib.util.find_spec(mod) else 'ABSENT'}")
t0 = time.time()
import cudnn  # noqa: E402

print(f"cudnn-frontend {cudnn.__version__}, backend {cudnn.backend_version_string()}, import {time.time() - t0:.2f}s")
from delta_attn.ops import cudnn as C  # noqa: E402

torch.manual_seed(0)
lens = [37, 200, 64]
cu = torch.tensor([0, 37, 237, 301], dtype=torch.int32, device="cuda")
q, k, v = (torch.randn(301, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for window in ((16, 0), (8, 4), (5, -1)):
    ref, _ = reference.attention_varlen(q.double(), k.double(), v.double(), cu, cu, window_size=window)
    for off in (0, 1, 2):
        C.LEFT_BOUND_OFFSET = off
        try:
            out = da.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200, window_size=window, backend="cudnn")
            err = (out.double() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"window {window} left_bound = wl + {off}: max err {err}")
C.LEFT_BOUND_OFFSET = 1
print(C.graph_cache_stats())
