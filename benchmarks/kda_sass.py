#!/usr/bin/env python
"""Compile-only figures of the KDA kernels (no GPU needed): for every launch the Triton pipelines make at a
given shape, compile each tile candidate for sm_90a (Triton's bundled ptxas) and report shared memory against
the H200's 232,448 bytes, the candidate the launch layer would take, registers, spills and a hash of the SASS
instructions (two trees compile to the same machine code when the hashes agree).

The launches are recorded by running the host pipelines on CPU tensors with the launch replaced by a recorder,
so the specialisations are exactly the launchers' (constexprs, dtypes; pointers taken as 16-byte aligned).

    python benchmarks/kda_sass.py [--dims 128x128 256x256 ...] [--dtypes bf16 fp16 fp32] [--all-candidates]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from delta_attn.ops.kda import pipeline  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SHARED_LIMIT = 232448          # H200 / H100: bytes of shared memory a program may opt into
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
       torch.int32: "*i32", torch.int64: "*i64"}


def record(K: int, V: int, dtype: torch.dtype, B=2, T=130, H=2, HV=2):
    """Every launch of the training forward + backward, the inference forward and the decode step."""
    launches = []

    def rec(kernel, grid, args, fixed, candidates):
        launches.append((kernel, args, dict(fixed), tuple(candidates)))
        return candidates[0]

    real = pipeline.launch
    pipeline.launch = rec
    try:
        q, k = (torch.randn(B, T, H, K, dtype=dtype) for _ in range(2))
        v = torch.randn(B, T, HV, V, dtype=dtype)
        g = -torch.rand(B, T, HV, K, dtype=dtype)
        beta = torch.rand(B, T, HV, dtype=dtype)
        h0 = torch.zeros(B, HV, K, V)
        common = (q, k, v, g, beta, h0, None, None, None, K ** -0.5, None, True, True, False)
        o, final, saved = pipeline.train_forward(*common)
        pipeline.train_backward(q, k, v, g, beta, h0, None, None, None, saved, torch.randn_like(o), final,
                                K ** -0.5, None, True, False)
        pipeline.infer_forward(*common)
        pipeline.decode_step(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], h0.clone(), None, None, None,
                             K ** -0.5, None, True)
    finally:
        pipeline.launch = real
    return launches


def compile_one(kernel, args, fixed, tiles):
    names = kernel.arg_names
    consts = {**fixed, **dict(tiles.meta)}
    sig, attrs, pos = {}, {}, 0
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
            continue
        a = args[pos]
        pos += 1
        sig[n] = PTR[a.dtype] if isinstance(a, torch.Tensor) else ("fp32" if isinstance(a, float) else "i32")
        if isinstance(a, torch.Tensor):
            attrs[(names.index(n),)] = [["tt.divisibility", 16]]
    c = {(names.index(n),): v for n, v in consts.items() if n in names}
    ck = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=c, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(ptx, "w").write(ck.asm["ptx"])
        open(cubin, "wb").write(ck.asm["cubin"])
        info = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                              capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    # the instructions alone (no addresses, encodings or line info): equal hashes, equal machine code
    ins = "\n".join(ln.split(";")[0].split("*/", 1)[-1].strip() for ln in sass.splitlines()
                    if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln))
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    return int(ck.metadata.shared), regs, spill, hashlib.sha1(ins.encode()).hexdigest()[:10]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", nargs="*", default=["128x128"], help="KxV pairs")
    ap.add_argument("--dtypes", nargs="*", default=["bf16"])
    ap.add_argument("--all-candidates", action="store_true", help="compile every candidate, not only up to the fit")
    a = ap.parse_args()
    print("| dtype | K x V | kernel | flags | candidate | shared B | fits | regs | spill B | SASS sha1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst_ok = True
    for dt in a.dtypes:
        for dims in a.dims:
            K, V = map(int, dims.split("x"))
            seen = set()
            for kernel, args, fixed, cands in record(K, V, DTYPES[dt]):
                flags = ",".join(f"{k_}={v_}" for k_, v_ in fixed.items() if k_ in ("EXACT", "STORE_H", "USE_DHT"))
                key = (kernel.fn.__name__, flags, cands)
                if key in seen:
                    continue
                seen.add(key)
                fitted = False
                for j, t in enumerate(cands):
                    shared, regs, spill, sha = compile_one(kernel, args, fixed, t)
                    fits = shared <= SHARED_LIMIT
                    print(f"| {dt} | {K}x{V} | {kernel.fn.__name__} | {flags} | {j}: {dict(t.meta)} w{t.num_warps} "
                          f"s{t.num_stages} | {shared} | {'yes' if fits else 'no'} | {regs} | {spill} | {sha} |",
                          flush=True)
                    if fits and not fitted:
                        fitted = True
                        if not a.all_candidates:
                            break
                worst_ok &= fitted
    print(f"\nevery launch has a candidate within {SHARED_LIMIT} bytes: {'yes' if worst_ok else 'NO'}")


if __name__ == "__main__":
    main()
