#!/usr/bin/env python
"""Compile-only figures of the gated diagonal attention kernels (no GPU needed): sm_90a registers and
spills (``ptxas -v``) and SASS instruction counts (``cuobjdump -sass``, NOPs included) per 1024
elements, with SHFL (cross-thread shuffles) and MUFU counts, for the default tile kernels and the opt-in
rows variants at H = 16, D = 128, bf16, the launcher's specialisation (16-byte aligned pointers, T and
total divisible by 16, the mask-free EVEN path, no states).

Usage: python benchmarks/diag_sass.py [--no-lookback]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from delta_attn.ops.diag import kernels as K  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
H, D = 16, 128
FWD_PTRS = ["q", "k", "v", "g", "o"]
BWD_PTRS = ["q", "k", "v", "g", "do", "dq", "dk", "dv", "dg"]
INTS = {"T_seq": "i32", "total": "i32", "N": "i32", "n_tiles": "i32", "carry_stride": "i32"}
FP32 = {"h0": "*fp32", "ht": "*fp32", "dht": "*fp32", "dh0": "*fp32"}
I64 = {"ws": "*i64", "ws_f": "*i64", "ws_b": "*i64", "carries": "*i64", "cu": "*i32"}


def compile_kernel(kern, ptrs, consts, warps):
    names = kern.arg_names
    sig = {**{p: "*bf16" for p in ptrs}, **FP32, **I64, **INTS}
    s = {n: sig.get(n, "constexpr") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if s[n].startswith("*") or n in ("T_seq", "total")}
    c = {(names.index(n),): v for n, v in consts.items() if n in names}
    ck = triton.compile(ASTSource(fn=kern, signature=s, constexprs=c, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(ptx, "w").write(ck.asm["ptx"])
        open(cubin, "wb").write(ck.asm["cubin"])
        v = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                           capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    ins = [ln.split(";")[0].strip() for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    regs = int(re.search(r"Used (\d+) registers", v).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", v).group(1))
    return regs, spill, ins


def row(name, kern, ptrs, consts, warps, elems):
    regs, spill, ins = compile_kernel(kern, ptrs, consts, warps)
    per = 1024 / elems * warps   # every warp of the program issues its own instructions
    count = lambda op: sum(op in x for x in ins)  # noqa: E731
    print(f"| {name} | {regs} | {spill} | {len(ins) * per:.0f} | {count('SHFL') * per:.0f} | "
          f"{count('MUFU') * per:.0f} |", flush=True)


# rows forwards: (bt, bd, window, warps, hold, early q, split)
ROWS_FWD = [(16, 64, 8, 1, True, False, 1), (16, 64, 8, 1, True, True, 1), (16, 64, 4, 1, True, False, 1),
            (16, 64, 2, 1, True, False, 1), (32, 64, 8, 1, True, False, 1), (8, 64, 8, 1, True, False, 1),
            (16, 128, 8, 2, True, False, 1), (32, 128, 8, 1, False, False, 1), (32, 256, 2, 1, False, False, 1),
            (64, 64, 8, 1, False, False, 1)]
# split tiles: `split` segments of bt / split rows side by side, one or two per warp
SPLIT_FWD = [(16, 64, 8, 1, True, True, 1), (64, 64, 8, 4, True, True, 4), (128, 64, 8, 8, True, True, 8),
             (128, 32, 8, 4, True, True, 4), (64, 32, 8, 2, True, True, 2), (128, 32, 8, 2, True, True, 4),
             (256, 32, 8, 8, True, True, 8), (64, 64, 4, 4, True, True, 4), (128, 64, 8, 4, True, True, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-lookback", action="store_true", help="the kernels without the look-back")
    ap.add_argument("--split-only", action="store_true", help="only the rows forwards with split tiles")
    a = ap.parse_args()
    lb = not a.no_lookback
    base = dict(H=H, D=D, HAS_H0=False, IS_VARLEN=False, LOG_N=1, EVEN=True, LOOKBACK=lb)
    fwd = dict(base, STORE_FINAL=False)
    bwd = dict(base, HAS_DHT=False)
    print("| kernel (bt x bd, window, warps) | regs | spill B | SASS / 1024 el | SHFL / 1024 el | MUFU / 1024 el |")
    print("| --- | --- | --- | --- | --- | --- |")
    if not a.split_only:
        row("fwd tile 32x32 W8 1 warp (default)", K._diag_fwd_kernel, FWD_PTRS,
            dict(fwd, BT=32, BD=32, W=8, Q_EARLY=False), 1, 32 * 32)
    for bt, bd, w, warps, hold, early, split in (SPLIT_FWD if a.split_only else ROWS_FWD):
        row(f"fwd rows{'+hold' if hold else ''} {bt}x{bd} W{w} {warps} warp{', early q' if early else ''}"
            f"{f', split {split}' if split > 1 else ''}",
            K._diag_fwd_rows_kernel, FWD_PTRS,
            dict(fwd, BT=bt, BD=bd, W=w, HOLD=hold, Q_EARLY=early, FAST_EXP=True, SPLIT=split), warps, bt * bd)
    if a.split_only:
        return
    row("bwd tile 32x32 W8 1 warp (default)", K._diag_bwd_kernel, BWD_PTRS,
        dict(bwd, BT=32, BD=32, W=8, KV_EARLY=False), 1, 32 * 32)
    for bt, bd, w, warps in [(16, 64, 8, 1), (16, 64, 4, 1), (16, 64, 2, 1), (32, 64, 8, 1), (16, 128, 8, 2)]:
        row(f"bwd rows {bt}x{bd} W{w} {warps} warp", K._diag_bwd_rows_kernel, BWD_PTRS,
            dict(bwd, BT=bt, BD=bd, W=w, FAST_EXP=True), warps, bt * bd)


if __name__ == "__main__":
    main()
