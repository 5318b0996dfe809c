"""Host (Python) time of one eager decode or KDA prefill call, without a GPU.

Times ``da.kda_step``, ``da.gated_diag_step`` and ``da.flash_attn_with_kvcache`` at decode shapes, and ``da.kda``
without gradients (a prefill: on the CPU its split kernels, with the g <= 0 check's reduction), on CPU
tensors with ``backend="auto"`` (the Triton backend, which takes CPU tensors under ``TRITON_INTERPRET=1``),
with every Triton kernel replaced by a no-op launch: what remains is the library's own host work per call
(validation, backend dispatch, launch preparation, output allocation), which on a GPU runs before each
launch. Triton's own launcher (its argument binding) is not included. The launch layer's CUDA-only step
(the fitted-tiles look-up, :func:`delta_attn.ops._launch.launch`) is timed separately from the arguments of
the last call. Then cProfile lists the top functions by cumulative time.

    PYTHONPATH=src python benchmarks/experiments/host_overhead.py [--calls 2000] [--cache-len 256] [--profile-top 25]

The cache length does not change the host path (the caches are only addressed by the kernels): the
default keeps the CPU memory small; ``--cache-len 8192`` is the issue's shape (2 GiB of fp16 caches).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

os.environ["TRITON_INTERPRET"] = "1"    # before Triton is imported: the kernels become interpreter functions

import torch  # noqa: E402

import delta_attn as da  # noqa: E402
from delta_attn.ops import _launch  # noqa: E402
from delta_attn.ops.diag import launch as diag_launch  # noqa: E402
from delta_attn.ops.flash import launch as flash_launch  # noqa: E402
from delta_attn.ops.kda import launch as kda_launch  # noqa: E402


class NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **meta)`` does nothing but record the call."""

    def __init__(self, name: str):
        self.__name__ = name
        self.last = None

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.last = (grid, args, meta)
        return run


def stub_kernels() -> None:
    for module, names in ((kda_launch, ("_kda_step_kernel", "_kda_infer_intra_kernel", "_kda_fwd_scan_kernel")),
                          (diag_launch, ("_diag_step_kernel",)),
                          (flash_launch, ("_kvcache_append_kernel", "_kvcache_attn_kernel",
                                          "_kvcache_merge_kernel"))):
        for name in names:
            setattr(module, name, NoLaunch(name))


def cases(cache_len: int, dtype=torch.float16):
    """(name, zero-argument call) at the issue's decode shapes (one new token per sequence)."""
    torch.manual_seed(0)
    B, H, K = 64, 16, 128
    q, k, v = (torch.randn(B, 1, H, K, dtype=dtype) for _ in range(3))
    g = -torch.rand(B, 1, H, K, dtype=dtype)
    beta = torch.rand(B, 1, H, dtype=dtype)
    kda_pool = torch.zeros(B, H, K, K)
    slots = torch.randperm(B)
    diag_pool = torch.zeros(B, H, K)
    Hq, Hk, D = 32, 8, 128
    qc = torch.randn(B, 1, Hq, D, dtype=dtype)
    kc, vc = (torch.randn(B, 1, Hk, D, dtype=dtype) for _ in range(2))
    k_cache, v_cache = (torch.zeros(B, cache_len, Hk, D, dtype=dtype) for _ in range(2))
    lens = torch.full((B,), cache_len // 2, dtype=torch.int32)
    qp, kp, vp = (torch.randn(2, 16, H, K, dtype=dtype) for _ in range(3))     # small: the host path is the same
    gp, bp = -torch.rand(2, 16, H, K), torch.rand(2, 16, H)
    return [
        ("kda prefill", lambda: da.kda(qp, kp, vp, gp, bp, use_qk_l2norm=True)),
        ("kda_step", lambda: da.kda_step(q, k, v, g, beta, kda_pool)),
        ("kda_step state_indices", lambda: da.kda_step(q, k, v, g, beta, kda_pool, state_indices=slots)),
        ("gated_diag_step", lambda: da.gated_diag_step(q, k, v, g, diag_pool)),
        ("flash_attn_with_kvcache", lambda: da.flash_attn_with_kvcache(
            qc, k_cache, v_cache, kc, vc, cache_seqlens=lens, causal=True)),
    ]


def per_call_us(fn, calls: int) -> float:
    """Best of 3 runs of ``calls`` calls, in µs per call."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def launch_key_us(calls: int) -> float:
    """The CUDA-only part of ``launch``: the fitted-tiles key of the kvcache attention kernel's last launch."""
    kernel = flash_launch._kvcache_attn_kernel
    _, args, meta = kernel.last
    tile_names = {n for n, _ in flash_launch._attn_tiles(128, False)[0].meta}
    fixed = {n: x for n, x in meta.items() if n not in tile_names and n not in ("num_warps", "num_stages")}
    candidates = flash_launch._attn_tiles(128, False)
    t0 = time.perf_counter()
    for _ in range(calls):
        _launch._fitted_key(kernel, args, fixed, candidates, 0)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--cache-len", type=int, default=256)
    p.add_argument("--profile-top", type=int, default=25)
    a = p.parse_args()
    stub_kernels()
    torch.set_grad_enabled(False)
    runs = cases(a.cache_len)
    for _, fn in runs:        # first calls: imports, dispatch warm-up
        fn()
    print(f"host time per eager call ({a.calls} calls, best of 3; Triton launches stubbed out; "
          f"torch {torch.__version__})")
    for name, fn in runs:
        print(f"  {name:28s} {per_call_us(fn, a.calls):8.1f} us")
    if hasattr(_launch, "_fitted_key"):
        print(f"  {'launch key (CUDA only)':28s} {launch_key_us(a.calls):8.1f} us  (kvcache attention kernel)")
    for name, fn in runs:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(a.profile_top)
        print(f"\n=== {name}: top {a.profile_top} by cumulative time ({a.calls} calls, profiled) ===")
        lines = out.getvalue().splitlines()
        start = next(i for i, s in enumerate(lines) if s.lstrip().startswith("ncalls"))
        print("\n".join(lines[start:]))


if __name__ == "__main__":
    main()
