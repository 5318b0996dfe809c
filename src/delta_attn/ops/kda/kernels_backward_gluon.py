"""Factored intra-chunk backward of KDA training (Gluon, Hopper sm_90), with the per-chunk gradients of the scan's
operands folded in: ``kernels_backward._kda_bwd_chunk_grads_kernel`` followed by the ``EXACT=False`` launch of
``kernels_backward._kda_bwd_intra_kernel``, for bf16 q, k, v, fp32 or bf16 g (raw log decays, no gate parameters)
and beta, K = V = 128, 64-token chunks. It reads the chunk-start states S and the chunk-end state gradients dS
(bf16 [K, V] per chunk and value head), u (v_new), dO and du itself and forms dqg = dO S^T, dkd = u dS^T, dW = -du S^T,
dAqk = dO u^T and dgc = sum_v S dS on chip. Same outputs and flags as the two Triton launches: a (chunk, value head)
with a 16-channel group whose |G - G_mid| exceeds FACTOR_MAX (or is NaN throughout) is flagged, and the Triton
EXACT launch redoes it from DQG, DKD, DW, DAQK, DGC, which this kernel writes (fp32, the layout of
``_kda_bwd_chunk_grads_kernel``) for the flagged pairs only: the flag is known after step 2, whose K slices form G
anyway, and the pair's dW is formed again then; dAqk, dqg, dkd, dgc are written where they are formed.

One warpgroup per (chunk, value head); every product is a wgmma with M = the chunk's 64 tokens and both operands in
shared memory, so no operand tile takes registers. Precision per product:

* bf16 operands, fp32 accumulation for the products of stage 2 (dO S^T, u dS^T, -du S^T, dO u^T), as
  ``_kda_bwd_chunk_grads_kernel`` forms them (du rounded to bf16 once); dgc in fp32 from the bf16 S and dS;
* tf32 (fp32 tiles, as in the Triton kernel) for every product with T, dT or dA: T^T dU, dU (b v)^T, dW Kb^T,
  T^T dT T^T, T^T dW, dA fb, dA^T fc. T = (I + A)^-1 and dA = -T^T dT T^T are chained products of the UT
  transform, and every gradient but dq flows through them: bf16 would round them at 2^-9 where the Triton kernel
  rounds at 2^-11. tf32 wgmma reads K-major operands only, so a tile whose contraction runs over the
  tokens is stored transposed as well (T^T, dU^T, dW^T, dT^T, dA^T, fb^T, fc^T);
* bf16 for the two products with dAqk (dAqk fb, dAqk^T fa): dAqk = dO u^T is itself formed from bf16 tensors; it is
  rounded to bf16 once and the same tile feeds both products.

Every factor is rounded once to its operand type (fa, fb to bf16: fb feeds a bf16 and a tf32 product, and a bf16
value is exact in tf32; fc to tf32), and the pair terms of dG are formed from the same rounded values (read back
from shared memory): their row and column sums cancel in the reverse cumulative sum
(``kernels_backward._kda_bwd_factored``).

Steps (G = the chunk's cumulative floored log decay per channel, Gm = G - G[BT / 2 - 1]; b = beta;
qs = scale q / |q|, ks = k / |k|):

0. row norms of q and k; T (fp32) to shared memory as T and T^T;
1. by V slices of 64: dv = b (T^T dU), db = v . (T^T dU), dT = dU (b v)^T; du to shared memory as bf16;
2. by K slices of 16: dW = -du S^T; dT += dW Kb^T, Kb = b ks e^G; dKb = T^T dW, whose terms b e^G dKb (of dk and,
   times ks, of dG) go to DK, read back by the same threads in step 4, and e^G ks dKb to db; the range test's
   marks per channel, reduced to the flag after the last slice (no cross-warp reduction per slice). A
   flagged pair then writes FLAGS and, slice by slice again, DW;
3. dAqk = dO u^T (lower) to bf16 (and, flagged, to DAQK); dA = -T^T dT T^T (strictly lower);
4. by K slices of 16: fa = qs e^Gm, fb = ks e^-Gm, fc = b ks e^Gm to shared memory; the six products dAqk fb,
   dA fb, dA^T fc + dAqk^T fa, dqg = dO S^T, dkd = u dS^T, and dgc = sum_v S dS (flagged: dqg, dkd, dgc to DQG, DKD,
   DGC); dq, dk, db and dG; dd = reverse cumsum(dG) + exclusive cumsum(kdd) + e^G_last dgc, formed as
   sum(dG) + exclusive cumsum(kdd - dG) + e^G_last dgc (one forward scan), set to 0 where g < -FLOOR (a select:
   NaN stays NaN);
5. with use_qk_l2norm, the l2-norm backward of dq and dk (re-read where step 4 stored them, by the same threads).

dq and dk go to DQO / DKO in their dtype (q's for one value head per query head: no fp32 round trip); with
use_qk_l2norm step 4 stores r dy to the fp32 scratch DQ / DK and step 5 writes DQO / DKO. DK is also step 2's
fp32 scratch.

Memory: the K slices' raw tiles (g, k and the S rows for step 2; g, q, k and the S, dS rows for step 4) come by
cp.async into a one-slice stage, the next slice's issued as soon as the current one is in registers or its wgmmas
are done (step 2's first slice while step 1 runs, step 4's while step 3 runs); dO and u (bf16 [BT, V]) come by
cp.async during step 2 and stay for steps 3 and 4; du is stored as bf16 by step 1 and stays for step 2. The other
loads are issued together (step 0's and 5's loops unrolled). Global memory is read and written in the wgmma
accumulator layouts (two rows per thread: few addresses, 8-byte accesses); the cumulative sums run in CL (a
channel's 64 tokens in one warp: the scan never leaves it), reached by layout conversions.

Shared memory (106 KB: two programs per SM): T and T^T share one allocation with dA and dA^T, which replace them
after step 3's last product with T; dO and u share one; dKb's terms of dk and dG pass through DK (global memory:
32 KB written and read back per pair) rather than holding du, T^T and dW^T in step 4 (36 KB more: one program per
SM).

Registers (no spill with 4 warps): the products' operands stay in shared memory and step 4's wgmmas are issued
together; the terms that do not need the products are formed after them; in every loop the row stride and the
buffers' index pass through an opaque move (``_in_loop``), so that neither address tiles nor wgmma descriptors are
hoisted and held across the loop. Decays are powers of two by one MUFU.EX2 (``kernels_fused._ex2``).

Scope (``launch._bwd_intra_fused_unsupported`` says what is outside it): as above, TWO_FLOAT off.
"""
from __future__ import annotations

from .._gluon import gl, gluon

BT = 64          # tokens per chunk (the training chunk)
BK = 16          # channels per K slice (steps 2 and 4)
BV = 64          # values per V slice (step 1; the bf16 dO, u, du, S, dS tiles by V slices)
WARPS = 4        # one warpgroup: M = 64 tokens per wgmma

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    from .kernels_fused import _add, _ex2

    LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _in_loop(x, it):
        """x, through a move the compiler cannot see through, that depends on the loop counter ``it``: what is formed
        from it stays inside the loop (hoisted, every tensor's 64-bit address tile and every shared-memory
        descriptor of the wgmmas would be carried across the loop in registers, and spill). A row stride passes it
        as HV, not HV K: K's divisibility keeps the loads vectorised."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [x, it], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _ex2_here(x):
        """``_ex2`` formed where it is written: not merged with an equal one formed earlier (a shorter live range
        than holding that one)."""
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _round_tf32(x):
        """x rounded to the nearest tf32 value, kept in fp32 (``kernels_gate._kda_round_tf32``)."""
        bits = x.to(gl.int32, bitcast=True)
        return ((bits + 0x1000) & -8192).to(gl.float32, bitcast=True)

    @gluon.jit
    def _row_at(x, i, r):
        """Row r of a [BT, N] tile as an N vector (a select: a NaN in another row does not leak)."""
        return gl.sum(gl.where(i[:, None] == r, x, 0.0), 0)

    @gluon.jit
    def _tile(ptr, off, mr):
        """The tile at ptr + off (int32 offsets in the chunk; rows past the chunk's end: 0), as fp32."""
        return gl.load(ptr + off, mask=mr[:, None], other=0.0).to(gl.float32)

    @gluon.jit
    def _fetch(buf, ptr, row_stride, L, BT: gl.constexpr, BK: gl.constexpr, CP: gl.constexpr):
        """cp.async of the [BT, BK] tile at ptr (rows row_stride apart) into buf; rows at or past L are zero-filled."""
        i = gl.arange(0, BT, layout=gl.SliceLayout(1, CP))
        j = gl.arange(0, BK, layout=gl.SliceLayout(0, CP))
        async_copy.async_copy_global_to_shared(buf, ptr + (i[:, None] * row_stride + j[None, :]), mask=(i < L)[:, None])

    @gluon.jit
    def _cum_decay(d, mr, CL: gl.constexpr, FLOOR: gl.constexpr):
        """G in CL (a channel's tokens in one warp): the cumulative sum over the chunk's rows of the log decays d
        floored at -FLOOR (``kernels_gate._kda_chunk_decay``, GATE 0; rows past the chunk's end add 0)."""
        df = gl.where(mr[:, None], gl.where(d < -FLOOR, -FLOOR, d), 0.0)      # a select: NaN stays NaN
        return gl.associative_scan(gl.convert_layout(df, CL), 0, _add)

    @gluon.jit
    def _and(a, b):
        return a & b

    @gluon.jit
    def _range_marks(mx, k0, FACTOR_MAX: gl.constexpr, BK: gl.constexpr):
        """A K slice's marks for the factored range test of the Triton kernel (``_group_flag``), per channel of the
        slice (one 16-channel group; BK = 16): (1 where its max |G - G_mid| over the tokens exceeds FACTOR_MAX, the
        group's bit k0 / 16 where that max is NaN, i.e. the channel is NaN throughout: a NaN-ignoring max)."""
        gl.static_assert(BK == 16, "one K slice is one group of the range test")
        return gl.where(mx > FACTOR_MAX, 1, 0), gl.where(mx != mx, 1 << (k0 // BK), 0)

    @gluon.jit
    def _group_flag(over, nans):
        """1 when a 16-channel group fails the factored range test of the Triton kernel (``max <= FACTOR_MAX`` over
        the group, its max NaN only when every entry is), else 0: some channel's max exceeds FACTOR_MAX, or every
        channel of some group is NaN throughout. over, nans: per channel position of the K slices, the maximum and
        the bitwise or over the slices of ``_range_marks``."""
        return gl.maximum(gl.max(over, 0), gl.where(gl.reduce(nans, 0, _and) != 0, 1, 0))

    @gluon.jit
    def _chunk_program(chunk_info, H, HV):
        """A (chunk, value head) program's chunk c, value head hv, its q / k head h, the chunk's first packed row and
        its length (chunk_info: (sequence, first row, length) per chunk)."""
        c = gl.program_id(0).to(gl.int64)
        hv = gl.program_id(1).to(gl.int64)
        row0 = gl.load(chunk_info + c * 3 + 1).to(gl.int64)
        return c, hv, hv // (HV // H), row0, gl.load(chunk_info + c * 3 + 2)

    @gluon.jit
    def _kda_bwd_intra_fused_kernel(q, k, v, g, beta, chunk_info, TM, DU, HS, DH, VNEW, DO, DQG, DKD, DW, DAQK, DGC,
                                    DQ, DK, DQO, DKO, DV, DB, DG, FLAGS, scale, H, HV,
                                    K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
                                    BV: gl.constexpr, L2NORM: gl.constexpr, FLOOR: gl.constexpr,
                                    FACTOR_MAX: gl.constexpr, W: gl.constexpr, GBITS: gl.constexpr):
        gl.static_assert(BK % W == 0 and BK // W <= 32 and K % BK == 0 and V % BV == 0, "K, V: whole slices")
        NV: gl.constexpr = V // BV      # V slices of the state tiles and of dO, u, du
        c, hv, h, row0, L = _chunk_program(chunk_info, H, HV)
        # the chunk's first row of every tensor (64-bit, once); offsets inside the chunk are int32
        q = q + (row0 * H + h) * K
        k = k + (row0 * H + h) * K
        v = v + (row0 * HV + hv) * V
        DU = DU + (row0 * HV + hv) * V
        DV = DV + (row0 * HV + hv) * V
        DO = DO + (row0 * HV + hv) * V
        VNEW = VNEW + (row0 * HV + hv) * V
        HS = HS + (c * HV + hv) * K * V
        DH = DH + (c * HV + hv) * K * V
        g = g + (row0 * HV + hv) * K
        DQG = DQG + (row0 * HV + hv) * K
        DKD = DKD + (row0 * HV + hv) * K
        DW = DW + (row0 * HV + hv) * K
        DQ = DQ + (row0 * HV + hv) * K
        DK = DK + (row0 * HV + hv) * K
        DQO = DQO + (row0 * HV + hv) * K
        DKO = DKO + (row0 * HV + hv) * K
        DG = DG + (row0 * HV + hv) * K
        TM = TM + (row0 * HV + hv) * BT
        DAQK = DAQK + (row0 * HV + hv) * BT
        DGC = DGC + (c * HV + hv) * K
        sq_row = H * K                  # row strides
        sg_row = HV * K
        sv_row = HV * V
        sa_row = HV * BT
        # layouts: MA / MH the [BT, BK] accumulators of tf32 / bf16 wgmmas (the same registers), M64 / M64H the
        # [BT, BT] ones, MV the [BT, BV] ones; CL [BT, BK] with a channel's tokens in one warp (BT / LT per thread)
        MA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BK, 8])
        MH: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BK, 16])
        M64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BT, 8])
        M64H: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BT, 16])
        MV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BV, 8])
        LC: gl.constexpr = BK // W                  # lanes per warp along the channels
        LT: gl.constexpr = 32 // LC                 # lanes per warp along the tokens
        CL: gl.constexpr = gl.BlockedLayout([BT // LT, 1], [LT, LC], [1, W], [0, 1])
        GVEC: gl.constexpr = 128 // GBITS           # g values per 16-byte cp.async (GBITS: 32, or 16 for a bf16 g)
        CF: gl.constexpr = gl.BlockedLayout([1, GVEC], [32 * GVEC // BK, BK // GVEC], [W, 1], [1, 0])
        CH: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BK, BK // 8], [W, 1], [1, 0])
        CB: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BV, BV // 8], [W, 1], [1, 0])    # bf16 rows of BV
        RA: gl.constexpr = gl.SliceLayout(1, MA)
        CA: gl.constexpr = gl.SliceLayout(0, MA)
        RC: gl.constexpr = gl.SliceLayout(1, CL)
        CC: gl.constexpr = gl.SliceLayout(0, CL)
        R64: gl.constexpr = gl.SliceLayout(1, M64)
        C64: gl.constexpr = gl.SliceLayout(0, M64)
        RV: gl.constexpr = gl.SliceLayout(1, MV)
        CV: gl.constexpr = gl.SliceLayout(0, MV)
        # shared memory: fp32 [BT, BT] tiles T, T^T, dT^T, X = T^T dT, dA, dA^T; the V slice's dU, dU^T, b v; bf16
        # dO, u, du by V slices; the K slice's operands (step 2: dW, Kb, dW^T fp32; step 4: fb^T, fc^T fp32, fa, fb
        # bf16) and state rows S, dS (bf16 by V slices); dAqk bf16
        F32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        FK: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(4 * BK, 128), element_bitwidth=32, rank=2)
        GK: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(GBITS // 8 * BK, 128), element_bitwidth=GBITS,
                                                rank=2)               # g's K slices (FK for a float32 g)
        HK: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(2 * BK, 128), element_bitwidth=16, rank=2)
        HB: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(2 * BV, 128), element_bitwidth=16, rank=2)
        H64: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        tp_s = gl.allocate_shared_memory(gl.float32, [2, BT, BT], F32)     # T, T^T; then dA, dA^T (step 3)

        # 0. row norms of q, k (ones without L2NORM; the scale in rq), beta
        iA = gl.arange(0, BT, layout=RA)
        jA = gl.arange(0, BK, layout=CA)
        mrA = iA < L
        bA = gl.load(beta + (row0 + iA) * HV + hv, mask=mrA, other=0.0).to(gl.float32)
        if L2NORM:
            oqA = iA[:, None] * sq_row + jA[None, :]
            sq = gl.zeros([BT], gl.float32, RA)
            sk = gl.zeros([BT], gl.float32, RA)
            for k0 in gl.static_range(0, K, BK):         # unrolled: every slice's loads in flight at once
                qx = _tile(q + k0, oqA, mrA)
                kx = _tile(k + k0, oqA, mrA)
                sq += gl.sum(qx * qx, 1)
                sk += gl.sum(kx * kx, 1)
            nq = 1.0 / gl.sqrt(sq + 1e-6)
            rk = 1.0 / gl.sqrt(sk + 1e-6)
        else:
            nq = gl.full([BT], 1.0, gl.float32, RA)
            rk = gl.full([BT], 1.0, gl.float32, RA)
        rq = nq * scale
        # T, as T and T^T
        i64 = gl.arange(0, BT, layout=R64)
        j64 = gl.arange(0, BT, layout=C64)
        mr64 = i64 < L
        oa64 = i64[:, None] * sa_row + j64[None, :]
        T = _tile(TM, oa64, mr64)
        tp_s.index(0).store(T)
        tp_s.index(1).permute((1, 0)).store(T)

        # the raw tiles of a K slice (g, k, the S rows; step 4 adds q and the dS rows) come by cp.async one slice
        # ahead: step 2's first slice is in flight while step 1 runs
        rg_s = gl.allocate_shared_memory(g.dtype.element_ty, [1, BT, BK], GK)
        rk_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BK], HK)
        rs_s = gl.allocate_shared_memory(gl.bfloat16, [NV, BK, BV], HB)
        _fetch(rg_s.index(0), g, HV * K, L, BT, BK, CF)
        _fetch(rk_s.index(0), k, H * K, L, BT, BK, CH)
        for vh in gl.static_range(NV):
            _fetch(rs_s.index(vh), HS + vh * BV, V, BK, BK, BV, CB)
        async_copy.commit_group()

        # 1. U = T (b v): dv = b T^T dU, db = v . T^T dU, dT = dU (b v)^T, V slice by V slice; du to bf16 (the
        #    operand of dW = -du S^T)
        iV = gl.arange(0, BT, layout=RV)
        mrV = iV < L
        ovV = iV[:, None] * sv_row + gl.arange(0, BV, layout=CV)[None, :]
        bV = gl.convert_layout(bA, RV)
        du_s = gl.allocate_shared_memory(gl.float32, [1, BT, BV], F32)
        dut_s = gl.allocate_shared_memory(gl.float32, [1, BV, BT], F32)
        bv_s = gl.allocate_shared_memory(gl.float32, [1, BT, BV], F32)
        duh_s = gl.allocate_shared_memory(gl.bfloat16, [NV, BT, BV], HB)
        dT = gl.zeros([BT, BT], gl.float32, M64)
        dbV = gl.zeros([BT], gl.float32, RV)
        for v0 in range(0, V, BV):
            z = _in_loop(0, v0)                     # the buffers at a run-time index: their wgmma descriptors are
            tt = tp_s.index(z + 1)                  # formed in the loop, not hoisted and held in registers
            du_b = du_s.index(z)
            dut_b = dut_s.index(z)
            bv_b = bv_s.index(z)
            du = _tile(DU + v0, ovV, mrV)
            vs = _tile(v + v0, ovV, mrV)
            gl.thread_barrier()                     # the previous slice's wgmmas are done with the buffers
            du_b.store(du)
            dut_b.permute((1, 0)).store(du)
            bv_b.store(bV[:, None] * vs)
            duh_s.index(z + v0 // BV).store(du.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            dbv = warpgroup_mma(tt, dut_b.permute((1, 0)), gl.zeros([BT, BV], gl.float32, MV), is_async=True)
            dT = warpgroup_mma(du_b, bv_b.permute((1, 0)), dT, is_async=True)
            dbv, dT = warpgroup_mma_wait(0, deps=[dbv, dT])
            gl.store(DV + v0 + ovV, (bV[:, None] * dbv).to(DV.dtype.element_ty), mask=mrV[:, None])
            dbV += gl.sum(vs * dbv, 1)
        gl.thread_barrier()                         # every warp's wgmmas are done with the slice buffers
        db = gl.convert_layout(dbV, RA)

        # 2. K slice by K slice: dW = -du S^T (bf16 operands); W = T Kb, Kb = b ks e^G: dT += dW Kb^T; dKb = T^T dW,
        #    whose term b e^G dKb of dk goes to DK (step 4 adds the rest) and e^G ks dKb to db; the factored range
        #    test (the flag); dO and u come by cp.async (for steps 3 and 4)
        iC = gl.arange(0, BT, layout=RC)
        jC = gl.arange(0, BK, layout=CC)
        zero = gl.zeros([BT, BK], gl.float32, MA)
        zeroh = gl.zeros([BT, BK], gl.float32, MH)
        ou_s = gl.allocate_shared_memory(gl.bfloat16, [2 * NV, BT, BV], HB)     # dO, u by V slices
        dw_s = gl.allocate_shared_memory(gl.float32, [1, BT, BK], FK)
        kb_s = gl.allocate_shared_memory(gl.float32, [1, BT, BK], FK)
        dwt_s = gl.allocate_shared_memory(gl.float32, [1, BK, BT], F32)
        over = gl.zeros([BK], gl.int32, CC)         # the slices' range marks (_range_marks), reduced after them
        nans = gl.zeros([BK], gl.int32, CC)
        for k0 in range(0, K, BK):
            z = _in_loop(0, k0)
            tt = tp_s.index(z + 1)
            dw_b = dw_s.index(z)
            kb_b = kb_s.index(z)
            dwt = dwt_s.index(z)
            rg = rg_s.index(z)
            rkb = rk_s.index(z)
            og = iA[:, None] * (_in_loop(HV, k0) * K) + jA[None, :]
            async_copy.wait_group(0)
            fence_async_shared()                    # the S rows are read by the wgmma
            gl.thread_barrier()
            dw = zeroh
            for vh in gl.static_range(NV):
                dw = warpgroup_mma(duh_s.index(z + vh), rs_s.index(z + vh).permute((1, 0)), dw, is_async=True)
            d = rg.load(MA).to(gl.float32)
            kr = rkb.load(MA).to(gl.float32)
            gl.thread_barrier()                     # every thread has read g, k: the next slice's may come
            if k0 + BK < K:
                _fetch(rg, g + k0 + BK, HV * K, L, BT, BK, CF)
                _fetch(rkb, k + k0 + BK, H * K, L, BT, BK, CH)
            if k0 == 0:
                for vh in gl.static_range(NV):
                    _fetch(ou_s.index(z + vh), DO + vh * BV, sv_row, L, BT, BV, CB)
                    _fetch(ou_s.index(z + NV + vh), VNEW + vh * BV, sv_row, L, BT, BV, CB)
            async_copy.commit_group()
            G = _cum_decay(d, mrA, CL, FLOOR)
            Gr = _row_at(G, iC, BT // 2 - 1)
            o1, n1 = _range_marks(gl.max(gl.abs(G - Gr[None, :]), 0), k0, FACTOR_MAX, BK)
            over = gl.maximum(over, o1)
            nans = nans | n1
            eG = gl.convert_layout(_ex2(G * LOG2E), MA)
            ks = kr * rk[:, None]
            kbv = bA[:, None] * ks * eG
            dw = warpgroup_mma_wait(0, deps=[dw])
            dw = -gl.convert_layout(dw, MA, assert_trivial=True)
            gl.thread_barrier()                     # every warp's wgmma is done with the S rows
            if k0 + BK < K:
                for vh in gl.static_range(NV):
                    _fetch(rs_s.index(z + vh), HS + (k0 + BK) * V + vh * BV, V, BK, BK, BV, CB)
                async_copy.commit_group()
            dw_b.store(dw)
            dwt.permute((1, 0)).store(dw)
            kb_b.store(kbv)
            fence_async_shared()
            gl.thread_barrier()
            dT = warpgroup_mma(dw_b, kb_b.permute((1, 0)), dT, is_async=True)
            dKb = warpgroup_mma(tt, dwt.permute((1, 0)), zero, is_async=True)
            dT, dKb = warpgroup_mma_wait(0, deps=[dT, dKb])
            db += gl.sum(eG * ks * dKb, 1)
            gl.store(DK + k0 + og, bA[:, None] * eG * dKb, mask=mrA[:, None])
        gl.thread_barrier()                         # step 2's reads of the slice buffers are done
        flag = _group_flag(over, nans)
        if flag != 0:
            # redone by the EXACT launch (whatever is written here but its inputs: dW now, dAqk in step 3, dqg, dkd,
            # dgc in step 4)
            gl.store(FLAGS + c * HV + hv, 1)
            for k0 in range(0, K, BK):
                z = _in_loop(0, k0)
                for vh in gl.static_range(NV):
                    _fetch(rs_s.index(z + vh), HS + k0 * V + vh * BV, V, BK, BK, BV, CB)
                async_copy.commit_group()
                async_copy.wait_group(0)
                fence_async_shared()
                gl.thread_barrier()
                dw = zeroh
                for vh in gl.static_range(NV):
                    dw = warpgroup_mma(duh_s.index(z + vh), rs_s.index(z + vh).permute((1, 0)), dw, is_async=True)
                dw = warpgroup_mma_wait(0, deps=[dw])
                gl.thread_barrier()
                og = iA[:, None] * (_in_loop(HV, k0) * K) + jA[None, :]
                gl.store(DW + k0 + og, -gl.convert_layout(dw, MA, assert_trivial=True), mask=mrA[:, None])

        # 3. dAqk = dO u^T (bf16 operands; lower-triangular, to bf16); T = (I + A)^-1: dA = -T^T dT T^T (strictly
        #    lower) (a barrier after each wgmma: a buffer written next may take the place of one that another warp's
        #    wgmma still reads)
        rq_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BK], HK)
        rd_s = gl.allocate_shared_memory(gl.bfloat16, [NV, BK, BV], HB)
        rg_s = gl.allocate_shared_memory(g.dtype.element_ty, [1, BT, BK], GK)
        rk_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BK], HK)
        rs_s = gl.allocate_shared_memory(gl.bfloat16, [NV, BK, BV], HB)
        _fetch(rg_s.index(0), g, HV * K, L, BT, BK, CF)          # step 4's first slice, while step 3 runs
        _fetch(rk_s.index(0), k, H * K, L, BT, BK, CH)
        _fetch(rq_s.index(0), q, H * K, L, BT, BK, CH)
        for vh in gl.static_range(NV):
            _fetch(rs_s.index(vh), HS + vh * BV, V, BK, BK, BV, CB)
            _fetch(rd_s.index(vh), DH + vh * BV, V, BK, BK, BV, CB)
        async_copy.commit_group()
        dtt_s = gl.allocate_shared_memory(gl.float32, [1, BT, BT], F32)
        dtt_s.index(0).permute((1, 0)).store(dT)
        fence_async_shared()
        gl.thread_barrier()
        X = warpgroup_mma(tp_s.index(1), dtt_s.index(0).permute((1, 0)), gl.zeros([BT, BT], gl.float32, M64),
                          is_async=True)
        dAqk = gl.zeros([BT, BT], gl.float32, M64H)
        for vh in gl.static_range(NV):
            dAqk = warpgroup_mma(ou_s.index(vh), ou_s.index(NV + vh).permute((1, 0)), dAqk, is_async=True)
        X, dAqk = warpgroup_mma_wait(0, deps=[X, dAqk])
        dAqk = gl.convert_layout(dAqk, M64, assert_trivial=True)
        gl.thread_barrier()
        x_s = gl.allocate_shared_memory(gl.float32, [1, BT, BT], F32)
        aq_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BT], H64)
        x_s.index(0).store(X)
        aq_s.index(0).store(gl.where(i64[:, None] >= j64[None, :], dAqk, 0.0).to(gl.bfloat16))
        if flag != 0:
            gl.store(DAQK + oa64, dAqk, mask=mr64[:, None])
        fence_async_shared()
        gl.thread_barrier()
        Y = warpgroup_mma(x_s.index(0), tp_s.index(0).permute((1, 0)), gl.zeros([BT, BT], gl.float32, M64))
        gl.thread_barrier()
        dA = gl.where(i64[:, None] > j64[None, :], -Y, 0.0)
        tp_s.index(0).store(dA)
        tp_s.index(1).permute((1, 0)).store(dA)

        # 4. per K slice: dqg = dO S^T, dkd = u dS^T (bf16 operands), dgc = sum_v S dS; the decayed products
        #    factored at the middle token; dq, dk, db, dG
        fbt_s = gl.allocate_shared_memory(gl.float32, [1, BK, BT], F32)
        fct_s = gl.allocate_shared_memory(gl.float32, [1, BK, BT], F32)
        fa_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BK], HK)
        fb_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BK], HK)
        dotq = gl.zeros([BT], gl.float32, RA)
        dotk = gl.zeros([BT], gl.float32, RA)
        for k0 in range(0, K, BK):
            z = _in_loop(0, k0)
            da = tp_s.index(z)
            dat = tp_s.index(z + 1)
            aq = aq_s.index(z)
            fbt = fbt_s.index(z)
            fct = fct_s.index(z)
            fa_b = fa_s.index(z)
            fb_b = fb_s.index(z)
            og = iA[:, None] * (_in_loop(HV, k0) * K) + jA[None, :]
            # 4a. the slice's tiles from the cp.async stage, the next slice's g, q, k issued; decays: G (CL), its
            #     rows L - 1 and BT / 2 - 1
            rg = rg_s.index(z)
            rkb = rk_s.index(z)
            rqb = rq_s.index(z)
            async_copy.wait_group(0)
            fence_async_shared()                    # the S, dS rows are read by the wgmmas
            gl.thread_barrier()
            d = rg.load(MA).to(gl.float32)
            qs = rqb.load(MA).to(gl.float32) * rq[:, None]
            ks = rkb.load(MA).to(gl.float32) * rk[:, None]
            gl.thread_barrier()                     # every thread has read them: the next slice's may come
            if k0 + BK < K:
                _fetch(rg, g + k0 + BK, HV * K, L, BT, BK, CF)
                _fetch(rkb, k + k0 + BK, H * K, L, BT, BK, CH)
                _fetch(rqb, q + k0 + BK, H * K, L, BT, BK, CH)
                async_copy.commit_group()
            G = _cum_decay(d, mrA, CL, FLOOR)
            Gl = _row_at(G, iC, L - 1)
            Gr = _row_at(G, iC, BT // 2 - 1)
            GA = gl.convert_layout(G, MA)
            GlA = gl.convert_layout(Gl, CA)[None, :]
            Gm = GA - gl.convert_layout(Gr, CA)[None, :]
            # 4b. the factors, rounded once (fa, fb to bf16, fc to tf32), to shared memory
            Xa = bA[:, None] * ks
            eP = _ex2(Gm * LOG2E)
            fa = (qs * eP).to(gl.bfloat16)
            fb = (ks * _ex2(-Gm * LOG2E)).to(gl.bfloat16)
            fc = _round_tf32(Xa * eP)
            fa_b.store(fa)                          # (the barriers above follow the last slice's reads)
            fb_b.store(fb)
            fbt.permute((1, 0)).store(fb.to(gl.float32))
            fct.permute((1, 0)).store(fc)
            fence_async_shared()
            gl.thread_barrier()
            # 4c. P1 = eP dAqk fb, P3 = eP dA fb, P24 = eN (dAqk^T fa + dA^T fc); dqg, dkd; dgc (the state rows read
            #     while the wgmmas run), then the next slice's S, dS rows issued; b e^G dKb from DK (step 2)
            d3 = warpgroup_mma(da, fbt.permute((1, 0)), zero, is_async=True)
            d4 = warpgroup_mma(dat, fct.permute((1, 0)), zero, is_async=True)
            d1 = warpgroup_mma(aq, fb_b, zeroh, is_async=True)
            d2 = warpgroup_mma(aq.permute((1, 0)), fa_b, zeroh, is_async=True)
            dqg = zeroh
            dkd = zeroh
            for vh in gl.static_range(NV):
                dqg = warpgroup_mma(ou_s.index(z + vh), rs_s.index(z + vh).permute((1, 0)), dqg, is_async=True)
                dkd = warpgroup_mma(ou_s.index(z + NV + vh), rd_s.index(z + vh).permute((1, 0)), dkd, is_async=True)
            beK = gl.load(DK + k0 + og, mask=mrA[:, None], other=0.0)
            dgc = gl.zeros([BK], gl.float32, gl.SliceLayout(1, CB))
            for vh in gl.static_range(NV):
                dgc += gl.sum(rs_s.index(z + vh).load(CB).to(gl.float32) * rd_s.index(z + vh).load(CB).to(gl.float32),
                              1)
            d3, d4, d1, d2, dqg, dkd = warpgroup_mma_wait(0, deps=[d3, d4, d1, d2, dqg, dkd])
            gl.thread_barrier()                     # every warp's wgmmas are done with the S, dS rows
            if k0 + BK < K:
                for vh in gl.static_range(NV):
                    _fetch(rs_s.index(z + vh), HS + (k0 + BK) * V + vh * BV, V, BK, BK, BV, CB)
                    _fetch(rd_s.index(z + vh), DH + (k0 + BK) * V + vh * BV, V, BK, BK, BV, CB)
                async_copy.commit_group()
            dgc = gl.convert_layout(dgc, CC)
            dqg = gl.convert_layout(dqg, MA, assert_trivial=True)
            dkd = gl.convert_layout(dkd, MA, assert_trivial=True)
            if flag != 0:                           # the EXACT launch's inputs
                gl.store(DQG + k0 + og, dqg, mask=mrA[:, None])
                gl.store(DKD + k0 + og, dkd, mask=mrA[:, None])
                gl.store(DGC + k0 + jC, dgc)
            d1 = gl.convert_layout(d1, MA, assert_trivial=True)
            d24 = d4 + gl.convert_layout(d2, MA, assert_trivial=True)
            # the pair terms of dG from the rounded factors (read back: not held across the products)
            dGp = (fa_b.load(MA).to(gl.float32) * d1 - fb_b.load(MA).to(gl.float32) * d24
                   + fct.permute((1, 0)).load(MA) * d3)
            # 4d. the terms without the factored products: eG dqg and qs e^G dqg (dq and dG), e^(G_last - G) dkd
            #     (dk) and kdd = ks e^(G_last - G) dkd, whose exclusive cumulative sum (CL) plus e^G_last dgc enters
            #     dd
            eG = _ex2_here(GA * LOG2E)
            eL = _ex2(-(GA - GlA) * LOG2E)
            dq0 = eG * dqg
            dG0 = qs * eG * dqg
            dk0 = eL * dkd
            kdd = gl.convert_layout(ks * eL * dkd, CL)
            # 4e. dq, dk, db (the exponentials formed again here: shorter live ranges than holding them)
            eP = _ex2_here(Gm * LOG2E)
            dqs = dq0 + eP * d1
            bP3 = bA[:, None] * (eP * d3)
            dks = _ex2_here(-Gm * LOG2E) * d24 + bP3 + dk0 + beK
            db += gl.sum(ks * (eP * d3), 1)
            dG = gl.where(mrA[:, None], gl.where(mrA[:, None], dG0 + ks * beK, 0.0) + dGp, 0.0)
            if L2NORM:                          # sum(dq * q) of the l2 norm's backward, as sum(dqs * qs)
                dotq += gl.sum(dqs * qs, 1)
                dotk += gl.sum(dks * ks, 1)
            if L2NORM:                          # r dy to the fp32 scratch, for step 5
                gl.store(DQ + k0 + og, dqs * rq[:, None], mask=mrA[:, None])
                gl.store(DK + k0 + og, dks * rk[:, None], mask=mrA[:, None])
            else:
                gl.store(DQO + k0 + og, dqs * rq[:, None], mask=mrA[:, None])
                gl.store(DKO + k0 + og, dks * rk[:, None], mask=mrA[:, None])
            # 4f. dd = reverse cumsum(dG) + exclusive cumsum(kdd) + e^G_last dgc, formed by one forward scan (CL):
            #     sum(dG) + exclusive cumsum(kdd - dG) + e^G_last dgc (a reverse scan would reverse the warp's lanes
            #     before and after it); the floor
            dGc = gl.convert_layout(dG, CL)
            x = kdd - dGc
            dd = (gl.associative_scan(x, 0, _add) - x) + (gl.sum(dGc, 0) + _ex2(Gl * LOG2E) * dgc)[None, :]
            dd = gl.convert_layout(dd, MA)
            dd = gl.where(d < -FLOOR, 0.0, dd)     # a select that keeps a NaN gate NaN
            gl.store(DG + k0 + og, dd, mask=mrA[:, None])
        gl.store(DB + (row0 + iA) * HV + hv, db, mask=mrA)

        # 5. l2-norm backward: dx = r (dy - y (y . dy)), y = r x; DQ / DK hold r dy (each thread re-reads the
        #    elements it stored: the same layout)
        if L2NORM:
            cq = nq * nq * dotq
            ck = rk * rk * dotk
            oqA = iA[:, None] * sq_row + jA[None, :]
            ogA = iA[:, None] * sg_row + jA[None, :]
            for k0 in gl.static_range(0, K, BK):         # unrolled: the loads of several slices in flight at once
                gq = _tile(DQ + k0, ogA, mrA) - _tile(q + k0, oqA, mrA) * cq[:, None]
                gk = _tile(DK + k0, ogA, mrA) - _tile(k + k0, oqA, mrA) * ck[:, None]
                gl.store(DQO + k0 + ogA, gq, mask=mrA[:, None])
                gl.store(DKO + k0 + ogA, gk, mask=mrA[:, None])
else:
    _kda_bwd_intra_fused_kernel = None
