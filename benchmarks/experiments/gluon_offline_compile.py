"""Compile the shipped Gluon KDA kernels (the fused forward in both forms, the training intra-chunk forward and
backward, the two training scans) for sm_90a without a GPU and print what ptxas reports for each
specialisation: registers, spill, shared memory. Needs Triton 3.6 (the Gluon API the kernels are written for; e.g.
in a separate virtual environment with `pip install triton==3.6.0`), which bundles the ptxas it runs.

python benchmarks/experiments/gluon_offline_compile.py [--g fp32,bf16]
"""
import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import triton  # noqa: E402
import triton.backends.nvidia as nvidia  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from delta_attn.ops import _decay_max  # noqa: E402
from delta_attn.ops.kda import kernels_backward_gluon, kernels_fused, kernels_intra_gluon, kernels_scan_gluon  # noqa: E402,E501
from delta_attn.ops.kda import launch  # noqa: E402


def ptxas_report(kernel, pointers, constexprs, warps, divisible=(), options=None):
    """(shared bytes, ptxas's register / spill lines) of one specialisation; every pointer 16-byte aligned, as the
    launcher specialises them, and the ints named in ``divisible`` multiples of 16; ``options``: the launch's
    compile options beyond num_warps (maxnreg)."""
    names = kernel.arg_names
    sig = {n: ("constexpr" if n in constexprs else "fp32" if n == "scale" else
               "i32" if n in ("T", "H", "HQ", "HV", "GROUP") else pointers.get(n, "*fp32")) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n in divisible}
    src = GluonASTSource(kernel, sig, {(names.index(n),): v for n, v in constexprs.items()}, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, **(options or {})})
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        ptxas = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True).stderr
    lines = [ln.split("info    :")[-1].strip() for ln in out.splitlines() if "registers" in ln or "spill" in ln]
    return compiled.metadata.shared, "; ".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--g", default="fp32,bf16", help="g's (and the training kernels' beta's) dtypes")
    args = ap.parse_args()
    bf16 = {n: "*bf16" for n in ("q", "k", "v", "o", "DO", "DV", "DQO", "DKO", "HS", "DH", "QG", "KD", "W", "U",
                                 "AQK", "O", "VNEW", "DU")}
    ints = {n: "*i32" for n in ("cu", "chunk_info", "FLAGS", "seq_info")}
    common = dict(K=128, FACTOR_MAX=launch.FACTOR_MAX)
    for gty in [t for t in args.g.split(",") if t]:
        bits = 16 if gty in ("bf16", "fp16") else 32
        for l2 in (True, False):
            # the fused forward reads g in float32 (launch.fused_forward widens a 16-bit one); the training
            # kernels read g and beta in their dtype
            fused = dict(common, BT=launch.FUSED_CHUNK, W=launch.FUSED_WARPS, L2NORM=l2, VARLEN=False, HAS_H0=False,
                         STORE_FINAL=False, TAIL=False)
            rows = [
                ("fused forward", kernels_fused._kda_fused_fwd_kernel, dict(g="*fp32", beta="*fp32"), fused,
                 launch.FUSED_WARPS),
                ("fused forward ws", kernels_fused._kda_fused_ws_kernel, dict(g="*fp32", beta="*fp32"),
                 dict(fused, FACTOR_REGS=kernels_fused.FACTOR_REGS), launch.FUSED_WARPS),
            ] if bits == 32 else []
            rows += [
                (f"training intra{' gtop' if gtop else ''}", kernels_intra_gluon._kda_train_intra_fused_kernel,
                 dict(g=f"*{gty}", beta=f"*{gty}", GMAX="*fp32"),
                 dict(common, V=128, BT=launch.TRAIN_CHUNK, BK=launch.FUSED_INTRA_BK, BC=launch.FUSED_INTRA_BC,
                      L2NORM=l2, FLOOR=launch.DECAY_FLOOR, NW=launch.FUSED_INTRA_WARPS, GBITS=bits, GTOP=gtop),
                 launch.FUSED_INTRA_WARPS) for gtop in (False, True)
            ] + [
                ("training backward", kernels_backward_gluon._kda_bwd_intra_fused_kernel,
                 dict(g=f"*{gty}", beta=f"*{gty}"),
                 dict(common, V=128, BT=launch.TRAIN_CHUNK, BK=launch.FUSED_BWD_BK, BV=launch.FUSED_BWD_BV,
                      L2NORM=l2, FLOOR=launch.DECAY_FLOOR, W=launch.FUSED_BWD_WARPS, GBITS=bits),
                 launch.FUSED_BWD_WARPS),
            ]
            for name, kernel, ptrs, cx, warps in rows:
                ws = kernel is kernels_fused._kda_fused_ws_kernel      # launched at WS_MAXNREG
                shared, report = ptxas_report(kernel, {**bf16, **ints, **ptrs}, cx, warps,
                                              options=dict(maxnreg=kernels_fused.WS_MAXNREG) if ws else None)
                print(f"{name:18} g {gty} l2 {l2!s:5} shared {shared / 1024:6.1f} KB | {report}", flush=True)
    # the training scans read neither g nor q, k: one specialisation per tiling (V blocks of 64 for few chains, the
    # whole V for many: launch.scan_fused_tiles) and operand ring depth
    for chains in (1, 1 << 20):
        tilings = launch.scan_fused_tiles(chains, "cpu")
        for bv, nw in sorted({(t.get("BV"), t.get("NW")) for t in tilings}):
            for st in (1, 2):
                scan = dict(K=128, V=128, BT=launch.TRAIN_CHUNK, BV=bv, NW=nw, STAGES=st)
                for name, kernel, cx in (
                        ("forward scan", kernels_scan_gluon._kda_fwd_scan_fused_kernel,
                         dict(scan, USE_H0=False, STORE_FINAL=False, STORE_H=True)),
                        ("reverse scan", kernels_scan_gluon._kda_bwd_scan_fused_kernel,
                         dict(scan, USE_DHT=False, STORE_DH0=False))):
                    shared, report = ptxas_report(kernel, {**bf16, **ints}, cx, nw)
                    print(f"{name:18} BV {bv:3} stages {st} shared {shared / 1024:6.1f} KB | {report}",
                          flush=True)
    # the g check's reduction for training calls: one program per SM beside two of the training intra-chunk kernel
    for xty in ("fp32", "bf16"):
        shared, report = ptxas_report(_decay_max._positive_max_kernel,
                                      dict(x=f"*{xty}", partial="*fp32", n="i32", per_program="i32"),
                                      dict(BLOCK=_decay_max.BLOCK, STAGES=_decay_max.STAGES), _decay_max.WARPS,
                                      divisible=("n", "per_program"))
        print(f"{'g check max':18} x {xty}  shared {shared / 1024:6.1f} KB | {report}", flush=True)


if __name__ == "__main__":
    main()
