"""Compile-only figures of the KDA forward kernels for sm_90a, without a GPU: registers and spills
(ptxas -v) and static SASS counts (cuobjdump; loops are not unrolled, so sliced kernels' static counts
understate their executed work). bf16, K = V = 128, l2norm, plain gate.

    PYTHONPATH=src python benchmarks/kda_compile_only.py
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from delta_attn.ops.kda import chunk as C
from delta_attn.ops.kda import prep_lean as P


def compile_kernel(kern, sig, consts, warps, stages=3):
    names = kern.arg_names
    s = {n: sig.get(n, "constexpr") for n in names}
    c = {n: consts[n] for n in names if s[n] == "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if s[n].startswith("*")}
    src = ASTSource(fn=kern, signature=s, constexprs={(names.index(k),): v for k, v in c.items()}, attrs=attrs)
    t0 = time.time()
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": warps, "num_stages": stages})
    out = dict(compile_s=round(time.time() - t0, 1))
    bind = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(ck.asm["ptx"])
        txt = subprocess.run([bind + "/ptxas", "-v", "--gpu-name", "sm_90a", os.path.join(d, "k.ptx"), "-o", "/dev/null"],
                             capture_output=True, text=True).stderr
        open(os.path.join(d, "k.cubin"), "wb").write(ck.asm["cubin"])
        sass = subprocess.run([bind + "/cuobjdump", "-sass", os.path.join(d, "k.cubin")], capture_output=True,
                              text=True).stdout
    out["regs"] = int(re.search(r"Used (\d+) registers", txt).group(1))
    out["spill_B"] = int(re.search(r"(\d+) bytes spill stores", txt).group(1))
    ins = [re.sub(r"/\*[0-9a-f]+\*/", "", ln).strip() for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    out["instr"] = len(ins)
    for op in ("HMMA", "BAR", "SHFL", "MUFU", "LDS", "STS"):
        out[op] = sum(1 for ln in ins if re.match(r"(@!?U?P\w+\s+)?" + op, ln))
    return out


def main():
    sig = {n: "*bf16" for n in ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "W", "U", "QG", "KD", "AQK"]}
    sig.update({"chunk_info": "*i32", "GC": "*fp32", "FLAGS": "*i32", "TM": "*fp32", "scale": "fp32",
                "lower_bound": "fp32", "H": "i32", "HV": "i32"})
    d = dict(K=128, V=128, BT=16, BK=16, BV=64, KP=128, L2NORM=True, GATE=0, HAS_DT_BIAS=False, FLOOR=30.0,
             FACTOR_MAX=60.0, DOT_PREC="tf32")
    print("default prep16 (4 warps, 3 stages)", compile_kernel(C._kda_fwd_prep_kernel, dict(sig, AQK="*fp32"), d, 4))
    lean = dict(d, KS=32, EXACT=False, INV=1, INV_PREC="tf32x3")
    for name, c, w, st in [("lean", dict(INV=0), 4, 1), ("lean_dots", {}, 4, 1),
                           ("lean_dots tf32 inverse", dict(INV_PREC="tf32"), 4, 1), ("lean", dict(INV=0), 8, 2),
                           ("lean_dots exact launch", dict(EXACT=True), 4, 1),
                           ("lean_dots 32-token", dict(BT=32, BK=4), 4, 1),
                           ("lean_dots 32-token tf32 inverse", dict(BT=32, BK=4, INV_PREC="tf32"), 4, 1)]:
        print(f"{name} ({w} warps, {st} stages)", compile_kernel(P._kda_fwd_prep_lean_kernel, sig, {**lean, **c}, w, st))
    ssig = {n: "*bf16" for n in ["W", "U", "QG", "KD", "O", "VNEW", "HS", "AQK"]}
    ssig.update({"GC": "*fp32", "h0": "*fp32", "seq_info": "*i32", "HT": "*fp32", "HV": "i32", "NCMAX": "i32"})
    for bt, bv, w in ((16, 16, 4), (16, 64, 8), (32, 16, 4), (32, 64, 8)):
        consts = dict(K=128, V=128, BT=bt, KP=128, BV=bv, USE_H0=False, STORE_FINAL=False, STORE_H=False)
        print(f"scan BT {bt} BV {bv} ({w} warps, 3 stages, bf16 Aqk)",
              compile_kernel(C._kda_fwd_scan_kernel, ssig, consts, w))


if __name__ == "__main__":
    main()
