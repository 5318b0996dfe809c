"""Cold start: the first KDA forward+backward (and flash attention forward+backward) in a fresh process with an
empty Triton cache, and each kernel's compile time.

python benchmarks/experiments/cold_start.py [--shape 8x4096] [--ops kda flash] [--serial]
Each measurement runs in a new Python process with its own empty TRITON_CACHE_DIR. ``--serial`` also measures
the pipelines compiling one kernel after another (``compiled_together`` and the backward's compile ahead replaced by
no-ops) for comparison.
Prints one JSON line per run: import s, first call s, second call ms, and the compile s of each kernel
(``--split-driver``: Triton's CUDA driver set-up, compiled on its first use, timed apart as driver_s).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r'''
import contextlib, json, sys, time
t0 = time.perf_counter()
import torch
import delta_attn as da
from delta_attn.ops import _launch
t_import = time.perf_counter() - t0
op, B, T, serial, split = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
compiles = []
fit = _launch.fit
def timed_fit(kernel, *a, **kw):
    t = time.perf_counter()
    out = fit(kernel, *a, **kw)
    compiles.append((getattr(kernel, "__name__", None) or kernel.fn.__name__, round(time.perf_counter() - t, 2)))
    return out
_launch.fit = timed_fit
if serial:
    import delta_attn.ops.kda.launch as kl
    kl.compiled_together = contextlib.nullcontext
    kl._compile_backward = lambda *a, **k: None
H, D = 16, 128
dev = "cuda"
r = lambda *s: torch.randn(*s, device=dev)
if op == "kda":
    q, k, v = (r(B, T, H, D).bfloat16().requires_grad_() for _ in range(3))
    g = torch.nn.functional.logsigmoid(r(B, T, H, D) + 4.0).float().requires_grad_()
    beta = torch.rand(B, T, H, device=dev).float().requires_grad_()
    def call():
        o, _ = da.kda(q, k, v, g, beta, use_qk_l2norm=True, backend="triton")
        o.sum().backward()
else:
    q, k, v = (r(B, T, H, D).bfloat16().requires_grad_() for _ in range(3))
    def call():
        o = da.flash_attn_func(q, k, v, causal=True, backend="triton")
        o.sum().backward()
torch.cuda.synchronize()
driver = 0.0
if split:      # Triton's CUDA driver module (compiled on first use) timed apart from the call
    import triton
    t = time.perf_counter(); triton.runtime.driver.active.get_current_target(); driver = time.perf_counter() - t
t = time.perf_counter(); call(); torch.cuda.synchronize(); first = time.perf_counter() - t
t = time.perf_counter(); call(); torch.cuda.synchronize(); second = time.perf_counter() - t
print("RESULT " + json.dumps(dict(op=op, shape=f"{B}x{T}", serial=serial, import_s=round(t_import, 2),
                                 driver_s=round(driver, 2), first_s=round(first, 2),
                                 second_ms=round(second * 1e3, 1), compiles=compiles)))
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8x4096")
    ap.add_argument("--ops", nargs="+", default=["kda", "flash"])
    ap.add_argument("--serial", action="store_true")
    ap.add_argument("--split-driver", action="store_true", help="time Triton's driver set-up apart (driver_s)")
    a = ap.parse_args()
    B, T = a.shape.split("x")
    for op in a.ops:
        for serial in ([False, True] if a.serial and op == "kda" else [False]):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache)
                out = subprocess.run([sys.executable, "-c", CHILD, op, B, T, "1" if serial else "0",
                                      "1" if a.split_driver else "0"], env=env,
                                     capture_output=True, text=True)
                lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                print(lines[-1][7:] if lines else json.dumps(dict(op=op, error=out.stderr[-2000:])), flush=True)


if __name__ == "__main__":
    main()
