"""Prototype: a fused KDA inference forward in Gluon for Hopper (sm_90): one warpgroup per (head, sequence)
keeps the transposed state S^T [V, K] as a wgmma accumulator in registers across all chunks.

python benchmarks/experiments/kda_gluon_fwd.py [--compile-only]
--compile-only: compile for sm_90 without a GPU and print registers, spills, shared memory and the SASS
instruction count (Triton 3.6; a Triton 3.6 venv's site-packages on PYTHONPATH does it on a machine whose own
Triton is another version).
Default (CUDA GPU): relative error against ``delta_attn.kda(..., backend="torch")`` in float64 (B=2, T=64, H=2),
then a timing table against ``delta_attn.kda(..., backend="triton")`` and cuDNN-FE's KDA (if installed) at
64x1024, 8x4096 and 16x2048, long and strong decays (H=16).

Per chunk of BT = 16 tokens (q, k L2-normalised, scale folded into q; G = cumulative sum of g in the chunk,
Gl its last row):
  0. cp.async brings the next chunk's raw q, k, v, g, beta into the other stage of a two-stage ring
  Akk = strict_lower(beta_i (k e^G)(k e^-G)^T), Aqk = lower(q e^G (k e^-G)^T)   (mma_v2, bf16)
  T = (I + Akk)^-1 = (I - A)(I + A^2)(I + A^4)(I + A^8)                           (mma_v2, tf32)
  X^T = (beta v)^T - S^T (beta e^G k)^T          wgmma [V,K]x[K,BT], S^T the register A operand
  u^T = X^T T^T                                  wgmma [V,BT]x[BT,BT]
  o^T = S^T (q e^G)^T + u^T Aqk^T                wgmma, the old state
  S^T = S^T e^Gl + u^T (k e^(Gl - G))            wgmma [V,BT]x[BT,K] accumulating into the decayed state
The [BT, K] tiles of the decay work sit in one warp per 32 channels (all 16 tokens of a channel in one warp), so
the cumulative sum over tokens never leaves a warp. S^T is held as two [V, K/2] accumulators so that only one
half's bf16 copy (the A operand) is live at a time; the x / q products of one half are one asynchronous wgmma
group. Akk, Aqk and the wgmma B operands are bf16.
Limitations: dense equal-length sequences (T % 16 == 0), K = V = 128, no initial / final state, bf16 in and
out, one program per (head, sequence) (no split of long sequences); the factored e^G e^-G form of Akk / Aqk
needs |G| within ~80 over a chunk (fp32 / bf16 exponent range).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

BT = 16     # chunk length
WARPS = 4   # one warpgroup (8 warps: cross-warp sums and spills, measured 1.7x slower)
MAXNREG = None   # registers per thread (128 with 8 warps spills)
D = 128     # K = V


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _mm_tf32(a, b, M2: gl.constexpr):
    """a @ b for two [BT, BT] fp32 tiles in the mma_v2 layout M2 (tf32 products, fp32 accumulation)."""
    return mma_v2(gl.convert_layout(a, gl.DotOperandLayout(0, M2, 1)),
                  gl.convert_layout(b, gl.DotOperandLayout(1, M2, 1)), gl.zeros_like(a), input_precision="tf32")


@gluon.jit
def _issue_chunk(q, k, v, g, beta, q_s, k_s, v_s, g_s, b_s, row, H, h, K: gl.constexpr, BT: gl.constexpr,
                 CP: gl.constexpr, CG: gl.constexpr, CB: gl.constexpr):
    """cp.async of one chunk's raw q, k, v (bf16), g (fp32) [BT, K] and beta [BT] into one stage of the ring."""
    r = row + gl.arange(0, BT, layout=gl.SliceLayout(1, CP))
    c = gl.arange(0, K, layout=gl.SliceLayout(0, CP))
    off = (r[:, None] * H + h) * K + c[None, :]
    async_copy.async_copy_global_to_shared(q_s, q + off)
    async_copy.async_copy_global_to_shared(k_s, k + off)
    async_copy.async_copy_global_to_shared(v_s, v + off)
    rg = row + gl.arange(0, BT, layout=gl.SliceLayout(1, CG))
    cg = gl.arange(0, K, layout=gl.SliceLayout(0, CG))
    async_copy.async_copy_global_to_shared(g_s, g + (rg[:, None] * H + h) * K + cg[None, :])
    async_copy.async_copy_global_to_shared(b_s, beta + (row + gl.arange(0, BT, layout=CB)) * H + h)
    async_copy.commit_group()


@gluon.jit
def _kda_fwd_kernel(q, k, v, g, beta, o, T, H, scale, K: gl.constexpr, BT: gl.constexpr, W: gl.constexpr):
    h = gl.program_id(0)
    n = gl.program_id(1).to(gl.int64)
    KH: gl.constexpr = K // 2
    # layouts: BL the [BT, K] decay-work tiles (a warp holds all BT tokens of K / W channels: the cumulative sum
    # over tokens stays in the warp); SL the two halves S^T[:, :64], S^T[:, 64:] (wgmma accumulators
    # [V, K/2]: a half at a time goes to bf16 for the A operand, which keeps the register peak down);
    # PL the [V, BT] products; M2 the mma_v2 [BT, BT] products; CP / CG / CB the 16-byte cp.async copies
    BL: gl.constexpr = gl.BlockedLayout([2, 8], [8, 4], [1, W], [1, 0])
    SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, KH, 16])
    PL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BT, 16])
    M2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, W], instr_shape=[16, 8])
    CP: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])
    CG: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
    CB: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    PA: gl.constexpr = gl.DotOperandLayout(0, PL, 2)      # register A operand of the [V, *] x [*, BT] wgmmas
    SA: gl.constexpr = gl.DotOperandLayout(0, SL, 2)      # register A operand of the state update
    # shared memory: a two-stage ring of raw chunk inputs (cp.async); the K-wide operands [BT, K] (B operands
    # of the wgmmas, read transposed and by halves of K; and the bf16 operands of Akk / Aqk), the [BT, BT]
    # B operands, exp(Gl)
    KSH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    KSH3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    GSH3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    TSH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    VSH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], KSH3)  # raw q, k, v, g, beta ring
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], KSH3)
    vr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], KSH3)
    gr_s = gl.allocate_shared_memory(gl.float32, [2, BT, K], GSH3)
    br_s = gl.allocate_shared_memory(gl.float32, [2, BT], VSH)
    kb_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], KSH)     # -(beta e^G k)
    qg_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], KSH)     # q e^G
    kn_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], KSH)     # k e^-G
    kd_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], KSH)     # k e^(Gl - G)
    tt_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BT], TSH)    # T
    aq_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BT], TSH)    # Aqk
    gl_s = gl.allocate_shared_memory(gl.float32, [K], VSH)          # exp(Gl)

    rows = gl.arange(0, BT, layout=gl.SliceLayout(1, BL))
    prow = gl.arange(0, K, layout=gl.SliceLayout(1, PL))           # V channel of a [V, BT] tile
    pcol = gl.arange(0, BT, layout=gl.SliceLayout(0, PL))          # token of a [V, BT] tile
    mi = gl.arange(0, BT, layout=gl.SliceLayout(1, M2))
    mj = gl.arange(0, BT, layout=gl.SliceLayout(0, M2))
    eye = gl.where(mi[:, None] == mj[None, :], 1.0, 0.0)
    S0 = gl.zeros([K, KH], gl.float32, SL)                         # S^T[:, :K/2]
    S1 = gl.zeros([K, KH], gl.float32, SL)                         # S^T[:, K/2:]
    row0 = n * T                                                   # first token row of the sequence
    _issue_chunk(q, k, v, g, beta, qr_s.index(0), kr_s.index(0), vr_s.index(0), gr_s.index(0), br_s.index(0),
                 row0, H, h, K, BT, CP, CG, CB)
    for t0 in range(0, T, BT):
        # 0. prefetch the next chunk (the last one again at the end) into the other stage; wait for this one
        st = (t0 // BT) % 2
        gl.thread_barrier()                     # the previous chunk's readers are done with the buffers
        nxt = row0 + gl.minimum(t0 + BT, T - BT)
        _issue_chunk(q, k, v, g, beta, qr_s.index(1 - st), kr_s.index(1 - st), vr_s.index(1 - st),
                     gr_s.index(1 - st), br_s.index(1 - st), nxt, H, h, K, BT, CP, CG, CB)
        async_copy.wait_group(1)
        gl.thread_barrier()
        qc = qr_s.index(st).load(BL).to(gl.float32)
        kc = kr_s.index(st).load(BL).to(gl.float32)
        gc = gr_s.index(st).load(BL)
        bc = br_s.index(st).load(gl.SliceLayout(1, BL))
        # 1. L2 norm of q and k, scale into q
        qc = qc * (gl.rsqrt(gl.sum(qc * qc, 1) + 1e-6) * scale)[:, None]
        kc = kc * gl.rsqrt(gl.sum(kc * kc, 1) + 1e-6)[:, None]
        # 2. cumulative decay in the chunk; the decayed operands to shared memory (bf16)
        G = gl.associative_scan(gc, 0, _add)
        Gl = gl.sum(gl.where((rows == BT - 1)[:, None], G, 0.0), 0)
        eG = gl.exp(G)
        kp = kc * eG
        kb_s.store((-kp * bc[:, None]).to(gl.bfloat16))
        qg_s.store((qc * eG).to(gl.bfloat16))
        kn = kc * gl.exp(-G)
        eGl = gl.exp(Gl)
        kn_s.store(kn.to(gl.bfloat16))
        kd_s.store((kn * eGl[None, :]).to(gl.bfloat16))
        gl_s.store(eGl)
        gl.thread_barrier()
        # 3. Akk = -(kb kn^T) (beta_i in kb), Aqk = qg kn^T (bf16 mma_v2), masked
        knT = kn_s.permute((1, 0)).load(gl.DotOperandLayout(1, M2, 2))
        zero2 = gl.zeros([BT, BT], gl.float32, M2)
        akk = mma_v2(kb_s.load(gl.DotOperandLayout(0, M2, 2)), knT, zero2)
        aqk = mma_v2(qg_s.load(gl.DotOperandLayout(0, M2, 2)), knT, zero2)
        akk = gl.where(mi[:, None] > mj[None, :], -akk, 0.0)
        aqk = gl.where(mi[:, None] >= mj[None, :], aqk, 0.0)
        # 4. T = (I + Akk)^-1 by the doubling product (Akk strictly lower: A^16 = 0), tf32 mma_v2
        a2 = _mm_tf32(akk, akk, M2)
        a4 = _mm_tf32(a2, a2, M2)
        a8 = _mm_tf32(a4, a4, M2)
        tm = eye - akk
        tm = tm + _mm_tf32(tm, a2, M2)
        tm = tm + _mm_tf32(tm, a4, M2)
        tm = tm + _mm_tf32(tm, a8, M2)
        tt_s.store(tm.to(gl.bfloat16))
        aq_s.store(aqk.to(gl.bfloat16))
        fence_async_shared()                    # this thread's stores visible to the wgmmas' async proxy,
        gl.thread_barrier()                     # and every thread's
        # 5. the state products on the old state, by halves of K:
        #    X^T = (beta v)^T - S^T (beta e^G k)^T and (q e^G S)^T = S^T (q e^G)^T
        ptok = row0 + t0 + pcol
        vT = vr_s.index(st).permute((1, 0)).load(PL).to(gl.float32)                   # v^T [V, BT]
        x = vT * br_s.index(st).load(gl.SliceLayout(0, PL))[None, :]
        # a half at a time (its bf16 copy pinned before the issue by an empty wait: ptxas serialises every
        # wgmma of the kernel if a non-wgmma instruction touches wgmma registers while one is in flight)
        sa = gl.convert_layout(S0.to(gl.bfloat16), PA)
        sa = warpgroup_mma_wait(0, deps=[sa])
        x = warpgroup_mma(sa, kb_s.slice(0, KH, dim=1).permute((1, 0)), x, is_async=True)
        qs = warpgroup_mma(sa, qg_s.slice(0, KH, dim=1).permute((1, 0)), gl.zeros([K, BT], gl.float32, PL),
                           is_async=True)
        x, qs, sa = warpgroup_mma_wait(0, deps=[x, qs, sa])
        sa = gl.convert_layout(S1.to(gl.bfloat16), PA)
        sa = warpgroup_mma_wait(0, deps=[sa])
        x = warpgroup_mma(sa, kb_s.slice(KH, KH, dim=1).permute((1, 0)), x, is_async=True)
        qs = warpgroup_mma(sa, qg_s.slice(KH, KH, dim=1).permute((1, 0)), qs, is_async=True)
        x, qs, sa = warpgroup_mma_wait(0, deps=[x, qs, sa])
        # 6. u^T = X^T T^T
        u = warpgroup_mma(gl.convert_layout(x.to(gl.bfloat16), PA), tt_s.permute((1, 0)),
                          gl.zeros([K, BT], gl.float32, PL))
        ub = u.to(gl.bfloat16)
        # 7. o^T = (q e^G S)^T + u^T Aqk^T
        ot = warpgroup_mma(gl.convert_layout(ub, PA), aq_s.permute((1, 0)), qs)
        # 8. S^T = S^T e^Gl + u^T (k e^(Gl - G)), by halves of K (synchronous: issued asynchronously with
        #    step 7, ptxas serialised every wgmma of the kernel)
        ua = gl.convert_layout(ub, SA)
        S0 = warpgroup_mma(ua, kd_s.slice(0, KH, dim=1), S0 * gl_s.slice(0, KH).load(gl.SliceLayout(0, SL))[None, :])
        S1 = warpgroup_mma(ua, kd_s.slice(KH, KH, dim=1),
                           S1 * gl_s.slice(KH, KH).load(gl.SliceLayout(0, SL))[None, :])
        # 9. o[t, h, :] from o^T
        gl.store(o + (ptok[None, :] * H + h) * K + prow[:, None], ot.to(gl.bfloat16))


def gluon_kda_fwd(q, k, v, g, beta):
    """o (B, T, H, 128) bf16 of KDA with q, k L2-normalised in the kernel; zero initial state."""
    B, T, H, K = q.shape
    assert K == D and v.shape[-1] == D and T % BT == 0
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and g.dtype == beta.dtype == torch.float32
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty_like(v)
    _kda_fwd_kernel[(H, B)](q, k, v, g, beta, o, T, H, K ** -0.5, K=K, BT=BT, W=WARPS, num_warps=WARPS, maxnreg=MAXNREG)
    return o


def compile_only():
    """Compile for sm_90 with no GPU; report registers, spills and shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*fp32", "o": "*bf16",
           "T": "i32", "H": "i32", "scale": "fp32", "K": "constexpr", "BT": "constexpr", "W": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(6)}     # the tensors' pointers, as the JIT sees them
    src = GluonASTSource(_kda_fwd_kernel, sig, constexprs={"K": D, "BT": BT, "W": WARPS}, attrs=aligned)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS, "maxnreg": MAXNREG})
    # registers and spills: from the cubin's resource usage (n_regs / n_spills need a driver); the static count
    # of SASS instructions (the loop body is nearly all of it: an offline proxy for the instructions per chunk)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = os.path.join(d, "k.cubin"), os.path.join(d, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(ck.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(ck.asm["ptx"])
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
        # ptxas's own report: spill bytes, and whether it serialised the wgmmas (advisory C7514)
        pv = subprocess.run([os.path.join(tools, "ptxas"), "-v", "-arch=sm_90a", ptx, "-o", cubin],
                            capture_output=True, text=True).stderr
    regs = spills = None
    for tok in res.replace(",", " ").split():
        if tok.startswith("REG:"):
            regs = int(tok[4:])
        elif tok.startswith("STACK:"):
            spills = int(tok[6:])
    ops = collections.Counter(m.group(1).split(".")[0] for m in
                              re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
    print(f"triton {triton.__version__}, sm_90, num_warps={WARPS}, maxnreg={MAXNREG}: registers {regs}, "
          f"stack (spill) bytes {spills}, shared {ck.metadata.shared} B")
    print(f"SASS instructions {sum(ops.values())}:", " ".join(f"{k} {n}" for k, n in ops.most_common(12)))
    for line in pv.splitlines():
        if "spill" in line or "C7514" in line:
            print("ptxas:", line.strip())


def check():
    import delta_attn as da
    torch.manual_seed(0)
    B, T, H = 2, 64, 2
    q, k, v, g, beta = inputs(B, T, H)
    ref = da.kda(*(x.double() for x in (q, k, v, g, beta)), use_qk_l2norm=True, backend="torch")[0]
    out = gluon_kda_fwd(q, k, v, g, beta).double()
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    print(f"check B={B} T={T} H={H}: max |gluon - torch fp64| / max |ref| = {err:.3e}")


def inputs(B, T, H):
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    q, k, v = (r(B, T, H, D).bfloat16() for _ in range(3))
    g = torch.nn.functional.logsigmoid(r(B, T, H, D) + 4.0).float()     # long-memory decays
    beta = torch.rand(B, T, H, device="cuda").float()
    return q, k, v, g, beta


def bench():
    """Medians against the shipped Triton forward and cuDNN-FE called natively (``kda_prefill.py``'s inputs and
    call, beside this script), both decay regimes, one process."""
    import kda_prefill as kp
    print(f"{'shape':>9} {'decays':>6} {'gluon ms':>9} {'triton ms':>10} {'cuDNN-FE ms':>12} {'cuDNN/gluon':>12} "
          f"{'max rel diff':>13}")
    for B, T in [(64, 1024), (8, 4096), (16, 2048)]:
        for regime in ("long", "strong"):
            x = kp.inputs(B, T, regime)
            with torch.no_grad():
                ref = kp.ours_fn(*x)()
                out = gluon_kda_fwd(*x)
                diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                tg, tt = kp.bench(lambda x=x: gluon_kda_fwd(*x)), kp.bench(kp.ours_fn(*x))
                try:
                    tc = kp.bench(kp.cudnn_fn(*x))
                except ImportError:                 # nvidia-cudnn-frontend not installed
                    tc = float("nan")
            print(f"{f'{B}x{T}':>9} {regime:>6} {tg:9.3f} {tt:10.3f} {tc:12.3f} {tc / tg:12.2f} {diff:13.3e}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-only", action="store_true", help="compile for sm_90 without a GPU")
    args = p.parse_args()
    if args.compile_only:
        compile_only()
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --compile-only)")
    check()
    bench()


if __name__ == "__main__":
    main()
