"""Compile the flash forward kernel for sm_90 on any machine (no GPU needed) and report what the
compiler made of it: registers, spills, shared memory, the wgmma waits inside the main loop.

    python benchmarks/flash_compile_check.py --cfg 128,128,8,3 [--meta WS=1,USE_TMA=1] [--causal]
        [--dump DIR]     # keep the TTGIR / PTX / SASS of each config

Shape: bf16, contiguous (B, S, H, D) with H = 16, D = 128 (or --d 64: H = 32), S = 4096.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from delta_attn.ops.flash.kernels_fwd import _flash_fwd_kernel  # noqa: E402

PTRS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "CU_Q": "*bf16",
        "CU_K": "*bf16", "ALIBI": "*bf16", "SEED": "*bf16"}
FLOATS = {"scale", "softcap", "dropout_p"}


def compile_fwd(bm, bn, warps, stages, meta, causal=False, d=128, h=16, s=4096, b=8, dump=None):
    kern = _flash_fwd_kernel
    names = kern.arg_names
    sig, consts, attrs = {}, {}, {}
    st_t, st_h = h * d, d
    ints = dict(stride_qb=s * st_t, stride_qt=st_t, stride_qh=st_h, stride_kb=s * st_t, stride_kt=st_t,
                stride_kh=st_h, stride_vb=s * st_t, stride_vt=st_t, stride_vh=st_h, stride_ob=s * st_t,
                stride_ot=st_t, stride_oh=st_h, stride_lb=h * s, stride_lh=s, stride_lt=1, stride_ab=0,
                stride_ah=0, seqlen_q=s, seqlen_k=s, rng_stride=s, n_heads=h, group=1, wl=-1,
                wr=0 if causal else -1, SQ_BUCKET=s, SK_BUCKET=s)
    cex = dict(IS_VARLEN=False, PLAIN=True, SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, HAS_WL=False,
               HAS_WR=causal, REVERSE_M=causal, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn,
               TMA_OK=True, USE_TMA=False, WS=False, PIPE=False)
    cex.update(meta)
    for i, n in enumerate(names):
        if n in cex:
            sig[n] = "constexpr"
            consts[n] = cex[n]
        elif n in PTRS:
            sig[n] = PTRS[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in FLOATS:
            sig[n] = "fp32"
        else:
            v = ints[n]
            if v == 1:
                sig[n] = "constexpr"
                consts[n] = 1
            else:
                sig[n] = "i32"
                if v % 16 == 0 and v != 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", 90, 64)
    backend = triton.compiler.make_backend(target)
    opts = backend.parse_options({"num_warps": warps, "num_stages": stages})
    cc = triton.compile(src, target=target, options=opts.__dict__)
    ptx = cc.asm["ptx"]
    ttgir = cc.asm["ttgir"]
    info = dict(regs=cc.metadata.num_regs if hasattr(cc.metadata, "num_regs") else None,
                smem=cc.metadata.shared)
    # ptxas -v for registers / spills
    with tempfile.TemporaryDirectory() as td:
        p = os.path.join(td, "k.ptx")
        open(p, "w").write(ptx)
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        r = subprocess.run([ptxas, "-v", "-arch=sm_90a", p, "-o", os.path.join(td, "k.cubin")],
                           capture_output=True, text=True)
        rep = r.stderr
        m = re.search(r"Used (\d+) registers", rep)
        info["ptxas_regs"] = int(m.group(1)) if m else None
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep)
        info["spill"] = (int(m.group(1)), int(m.group(2))) if m else None
        info["ptxas_rc"] = r.returncode
    info["wgmma"] = len(re.findall(r"wgmma\.mma_async", ptx))
    info["waits"] = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    info["ttgir_waits"] = re.findall(r"warp_group_dot_wait .*pendings = (\d+)", ttgir)
    if dump:
        os.makedirs(dump, exist_ok=True)
        tag = f"{bm}x{bn}w{warps}s{stages}" + "".join(f"_{k}{int(v)}" for k, v in meta.items()) + ("_c" if causal else "")
        open(os.path.join(dump, tag + ".ttgir"), "w").write(ttgir)
        open(os.path.join(dump, tag + ".ptx"), "w").write(ptx)
    return info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", action="append", required=True)
    ap.add_argument("--meta", default="")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dump", default="")
    a = ap.parse_args()
    meta = {}
    for kv in filter(None, a.meta.split(",")):
        k, v = kv.split("=")
        meta[k] = bool(int(v))
    for c in a.cfg:
        bm, bn, w, st = (int(x) for x in c.split(","))
        try:
            info = compile_fwd(bm, bn, w, st, meta, a.causal, a.d, 16 if a.d == 128 else 32, dump=a.dump or None)
            print(c, meta, info)
        except Exception as e:
            print(c, meta, "FAILED", type(e).__name__, str(e)[:300])


if __name__ == "__main__":
    main()
