"""Intra-chunk stage of KDA training (Gluon, Hopper sm_90): the fast path of ``kernels_intra._kda_train_intra_kernel``
for bf16 q, k, v, fp32 or bf16 g (raw log decays, no gate parameters) and beta, K = V = 128, 64-token chunks.
Same inputs and outputs (W, U, QG, KD, AQK, GC, TM), and FLAGS[c, hv] written for every pair: 1 when one of the
chunk's 32-channel K slices fails the Triton kernel's factored range test ``max |G - G_mid| <= FACTOR_MAX`` (the
same NaN-ignoring maximum: a slice fails when a channel exceeds FACTOR_MAX or every entry is NaN), else 0. The
Triton kernel's ``ONLY_FLAGGED`` launch then redoes the flagged pairs (what this kernel wrote for them is overwritten).
With ``GTOP`` on, GMAX[c, hv] = max(0, the chunk's raw g), NaN read as 0: the g <= 0 check's reduction, read on the
host after this kernel alone (``launch._forward``).

One warpgroup per (chunk, value head); every product is a wgmma with M = the chunk's 64 tokens. Steps (G = the
cumulative floored log decay per channel, Gm = G - G[BT / 2 - 1], b = beta, qs = scale q / |q|, ks = k / |k|):

0. cp.async of the chunk's q, k (bf16) and g (as given; widened to fp32 when read), by K slices of 32, into shared
   memory (rows past the chunk's end zero-filled); the row norms of q and k from there;
1. per K slice: G (a channel's 64 tokens in one warp: ``CL``), the range test (with GTOP, g's maximum), QG = qs e^G,
   KD = ks e^(G_last - G), GC = e^G_last; the bf16 factors ks e^Gm, qs e^Gm, ks e^-Gm to shared memory and
   Akk += (ks e^Gm)(ks e^-Gm)^T, Aqk += (qs e^Gm)(ks e^-Gm)^T (bf16 wgmmas, fp32 accumulators); ks e^G (bf16) kept
   for W;
2. Akk = strict_lower(b_i Akk) and Aqk = strict_lower(Aqk) + diag(qs_i . ks_i) (the diagonal summed in fp32 in
   step 1, as the Triton kernel forms it, not from the bf16 factors), AQK stored; v comes by cp.async meanwhile;
3. T = (I + Akk)^-1 as the Triton kernel's ``_kda_block_tri_inverse``: the four 16x16 diagonal blocks inverted
   exactly in fp32 by forward substitution (FMAs, one warp per block), then X = Dinv - M X three times with
   M = Dinv N (N the blocks below the diagonal; tf32 wgmmas on K-major operands); T stored (TM, fp32);
4. U = T (b v) and W = T (b ks e^G): bf16 wgmmas with T a register operand, on the Triton kernel's bf16 operands
   (T, b v and b ks e^G each rounded once to bf16), stored bf16.

Every bf16 and tf32 operand is the Triton kernel's, rounded where it rounds it: the two kernels differ by the order
of their fp32 sums (cumulative decays, row norms, products) and by the tf32 / bf16 roundings that order moves.

Decays are powers of two by one MUFU.EX2 (``kernels_fused._ex2``); shared memory is allocated where first used, so
the raw q, k, g tiles (step 0-1) and the inverse's tiles (step 3) share it.

Scope (``launch._train_intra_fused_unsupported`` says what is outside it): as above, TWO_FLOAT off.
"""
from __future__ import annotations

from .._gluon import gl, gluon

BT = 64          # tokens per chunk (the training chunk)
BK = 32          # channels per K slice (the Triton kernel's BK: its range test is per slice)
BC = 16          # diagonal blocks of the inverse (the Triton kernel's BC)
WARPS = 4        # one warpgroup: M = 64 tokens per wgmma

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    from .kernels_backward_gluon import _chunk_program, _cum_decay, _fetch, _row_at
    from .kernels_fused import _ex2

    LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _rows_store(ptr, x, i, j, row_stride, mr):
        """x ([BT, N], any layout) at ptr + i * row_stride + j for the rows i < the chunk's length (mr)."""
        gl.store(ptr + (i[:, None] * row_stride + j[None, :]), x.to(ptr.dtype.element_ty), mask=mr[:, None])

    @gluon.jit
    def _kda_train_intra_fused_kernel(q, k, v, g, beta, chunk_info, W, U, QG, KD, AQK, GC, TM, FLAGS, GMAX, scale,
                                      H, HV, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr,
                                      BC: gl.constexpr, L2NORM: gl.constexpr, FLOOR: gl.constexpr,
                                      FACTOR_MAX: gl.constexpr, NW: gl.constexpr, GBITS: gl.constexpr,
                                      GTOP: gl.constexpr):
        gl.static_assert(BT == 64 and BC == 16 and BK == 32 and NW == 4, "a warpgroup, 64 tokens, 4 blocks of 16")
        gl.static_assert(K % BK == 0 and V % 64 == 0, "K, V: whole slices")
        NS: gl.constexpr = K // BK                  # K slices
        NB: gl.constexpr = BT // BC                 # diagonal blocks (one per warp)
        c, hv, h, row0, L = _chunk_program(chunk_info, H, HV)
        # the chunk's first row of every tensor (64-bit, once); offsets inside the chunk are int32
        q = q + (row0 * H + h) * K
        k = k + (row0 * H + h) * K
        g = g + (row0 * HV + hv) * K
        W = W + (row0 * HV + hv) * K
        QG = QG + (row0 * HV + hv) * K
        KD = KD + (row0 * HV + hv) * K
        v = v + (row0 * HV + hv) * V
        U = U + (row0 * HV + hv) * V
        AQK = AQK + (row0 * HV + hv) * BT
        TM = TM + (row0 * HV + hv) * BT
        beta = beta + row0 * HV + hv
        GC = GC + (c * HV + hv) * K

        # layouts: CL [BT, BK] with a channel's tokens in one warp (the cumulative sum never leaves it); VL [BT, BK]
        # 8 channels per thread (16-byte accesses); M64 / MF the [BT, BT] accumulators of bf16 / tf32 wgmmas (the same
        # registers), MV [BT, 64] and MK [BT, BK] those of U and W; L3 [NB, BC, BT] the forward substitution (a warp
        # per diagonal block, a block's 16 rows in each thread); CP* the 16-byte cp.async copies
        CL: gl.constexpr = gl.BlockedLayout([BT // 4, 1], [4, 8], [1, NW], [0, 1])
        VL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])
        M64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BT, 16])
        MF: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BT, 8])
        MV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, 64, 16])
        MK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BK, 16])
        L3: gl.constexpr = gl.BlockedLayout([1, BC, 2], [1, 1, 32], [NW, 1, 1], [2, 1, 0])
        GVEC: gl.constexpr = 128 // GBITS           # g values per 16-byte copy (GBITS: 32, or 16 for a bf16 g)
        CPF: gl.constexpr = gl.BlockedLayout([1, GVEC], [32 * GVEC // BK, BK // GVEC], [NW, 1], [1, 0])
        CPV: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        # shared memory: the raw slices (q, k: wgmma-style swizzle, conflict-free 16-byte reads; g: swizzled so that
        # CL's four token groups read four different banks); the factors (bf16 wgmma operands)
        HK: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BK, element_bitwidth=16, rank=2)
        H64: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        F32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        GSW: gl.constexpr = gl.SwizzledSharedLayout(8, BT // 4, 4, [1, 0])
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

        # 0. the raw slices by cp.async (q and k first: the row norms wait for them only)
        q_s = gl.allocate_shared_memory(gl.bfloat16, [NS, BT, BK], HK)
        k_s = gl.allocate_shared_memory(gl.bfloat16, [NS, BT, BK], HK)
        g_s = gl.allocate_shared_memory(g.dtype.element_ty, [NS, BT, BK], GSW)
        for s in gl.static_range(NS):
            _fetch(q_s.index(s), q + s * BK, H * K, L, BT, BK, VL)
            _fetch(k_s.index(s), k + s * BK, H * K, L, BT, BK, VL)
        async_copy.commit_group()
        for s in gl.static_range(NS):
            _fetch(g_s.index(s), g + s * BK, HV * K, L, BT, BK, CPF)
        async_copy.commit_group()
        RV: gl.constexpr = gl.SliceLayout(1, VL)
        iV = gl.arange(0, BT, layout=RV)
        jV = gl.arange(0, BK, layout=gl.SliceLayout(0, VL))
        mrV = iV < L
        bV = gl.load(beta + iV * HV, mask=mrV, other=0.0).to(gl.float32)
        if L2NORM:
            async_copy.wait_group(1)
            gl.thread_barrier()
            sq = gl.zeros([BT], gl.float32, RV)
            sk = gl.zeros([BT], gl.float32, RV)
            for s in gl.static_range(NS):
                qx = q_s.index(s).load(VL).to(gl.float32)
                kx = k_s.index(s).load(VL).to(gl.float32)
                sq += gl.sum(qx * qx, 1)
                sk += gl.sum(kx * kx, 1)
            rq = (1.0 / gl.sqrt(sq + 1e-6)) * scale
            rk = 1.0 / gl.sqrt(sk + 1e-6)
        else:
            rq = gl.full([BT], 1.0, gl.float32, RV) * scale
            rk = gl.full([BT], 1.0, gl.float32, RV)
        async_copy.wait_group(0)
        gl.thread_barrier()

        # 1. per K slice: decays, the range test, QG / KD / GC, the factors and the products
        RC: gl.constexpr = gl.SliceLayout(1, CL)
        iC = gl.arange(0, BT, layout=RC)
        jC = gl.arange(0, BK, layout=gl.SliceLayout(0, CL))
        mrC = iC < L
        fak_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BK], HK)
        faq_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BK], HK)
        kn_s = gl.allocate_shared_memory(gl.bfloat16, [1, BT, BK], HK)
        kg_s = gl.allocate_shared_memory(gl.bfloat16, [NS, BT, BK], HK)
        akk = gl.zeros([BT, BT], gl.float32, M64)
        aqk = gl.zeros([BT, BT], gl.float32, M64)
        qk = gl.zeros([BT], gl.float32, RV)         # Aqk's diagonal q_i . k_i (D_ii = 1) in fp32
        bad = gl.to_tensor(0)
        gtop = gl.zeros([BK], gl.float32, gl.SliceLayout(0, CL))    # max(0, raw g) per channel, NaN read as 0
        for s in range(NS):
            graw = g_s.index(s).load(CL).to(gl.float32)
            if GTOP:
                gtop = gl.maximum(gtop, gl.max(gl.where(graw != graw, 0.0, graw), 0))
            G = _cum_decay(graw, mrC, CL, FLOOR)
            Gl = _row_at(G, iC, L - 1)
            Gr = _row_at(G, iC, BT // 2 - 1)
            # the Triton kernel's test, as it is written (tl.max / gl.max ignore NaN: max NaN only if all are)
            ok = gl.max(gl.max(gl.abs(G - Gr[None, :]), 0), 0) <= FACTOR_MAX
            bad = gl.maximum(bad, gl.where(ok, 0, 1))
            gl.store(GC + s * BK + jC, _ex2(Gl * LOG2E))
            GV = gl.convert_layout(G, VL)
            GlV = gl.convert_layout(Gl, gl.SliceLayout(0, VL))[None, :]
            GrV = gl.convert_layout(Gr, gl.SliceLayout(0, VL))[None, :]
            qs = q_s.index(s).load(VL).to(gl.float32) * rq[:, None]
            ks = k_s.index(s).load(VL).to(gl.float32) * rk[:, None]
            qk += gl.sum(qs * ks, 1)
            eG = _ex2(GV * LOG2E)
            _rows_store(QG + s * BK, qs * eG, iV, jV, HV * K, mrV)
            _rows_store(KD + s * BK, ks * _ex2((GlV - GV) * LOG2E), iV, jV, HV * K, mrV)
            eP = _ex2((GV - GrV) * LOG2E)
            fak = (ks * eP).to(gl.bfloat16)
            faq = (qs * eP).to(gl.bfloat16)
            kn = (ks * _ex2((GrV - GV) * LOG2E)).to(gl.bfloat16)
            kg_s.index(s).store((bV[:, None] * ks * eG).to(gl.bfloat16))
            gl.thread_barrier()                     # every warp's products of the last slice are done
            fak_s.index(0).store(fak)
            faq_s.index(0).store(faq)
            kn_s.index(0).store(kn)
            fence_async_shared()
            gl.thread_barrier()
            knT = kn_s.index(0).permute((1, 0))
            akk = warpgroup_mma(fak_s.index(0), knT, akk, is_async=True)
            aqk = warpgroup_mma(faq_s.index(0), knT, aqk, is_async=True)
            akk, aqk = warpgroup_mma_wait(0, deps=[akk, aqk])
        gl.store(FLAGS + c * HV + hv, bad)
        if GTOP:
            gl.store(GMAX + c * HV + hv, gl.max(gtop, 0))
        gl.thread_barrier()                         # every warp is done with step 1's buffers (reused below)

        # 2. v by cp.async (for step 4); Akk = strict_lower(b_i Akk), Aqk = strict_lower(Aqk) + diag(qk), stored
        v_s = gl.allocate_shared_memory(gl.bfloat16, [V // 64, BT, 64], H64)
        iP = gl.arange(0, BT, layout=gl.SliceLayout(1, CPV))
        for s in gl.static_range(V // 64):
            _fetch(v_s.index(s), v + s * 64, HV * V, L, BT, 64, CPV)
        async_copy.commit_group()
        R64: gl.constexpr = gl.SliceLayout(1, M64)
        C64: gl.constexpr = gl.SliceLayout(0, M64)
        i64 = gl.arange(0, BT, layout=R64)
        j64 = gl.arange(0, BT, layout=C64)
        mr64 = i64 < L
        bR = gl.load(beta + i64 * HV, mask=mr64, other=0.0).to(gl.float32)
        akk = gl.where(i64[:, None] > j64[None, :], bR[:, None] * akk, 0.0)
        qk64 = gl.convert_layout(qk, R64)[:, None]
        aqk = gl.where(i64[:, None] > j64[None, :], aqk, gl.where(i64[:, None] == j64[None, :], qk64, 0.0))
        _rows_store(AQK, aqk, i64, j64, HV * BT, mr64)

        # 3. T = (I + Akk)^-1. The diagonal blocks D (a warp's own rows of the accumulator) as [BC rows, NB, BC] and
        #    N^T (the blocks below, stored transposed: tf32 wgmma operands are K-major)
        d_s = gl.allocate_shared_memory(gl.float32, [BC * NB, BC], PLAIN)     # row rr * NB + n: D[n][rr, :]
        nt_s = gl.allocate_shared_memory(gl.float32, [BT, BT], F32)
        bi = i64 // BC
        bj = j64 // BC
        D = gl.sum(gl.reshape(gl.where(bi[:, None] == bj[None, :], akk, 0.0), [NB, BC, NB, BC]), 2)
        d_s.store(gl.reshape(gl.permute(D, (1, 0, 2)), [BC * NB, BC]))
        nt_s.permute((1, 0)).store(gl.where(bi[:, None] > bj[None, :], akk, 0.0))
        gl.thread_barrier()
        #    Dinv: forward substitution on the four blocks at once, rows of Y = [block, row, column of the chunk]
        S2: gl.constexpr = gl.SliceLayout(2, L3)
        n3 = gl.arange(0, NB, layout=gl.SliceLayout(1, S2))
        r3 = gl.arange(0, BC, layout=gl.SliceLayout(0, S2))
        c3 = gl.arange(0, BT, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        Y = gl.where(c3[None, None, :] == (n3[:, None] * BC + r3[None, :])[:, :, None], 1.0, 0.0)
        for rr in gl.static_range(1, BC):
            arow = d_s.slice(rr * NB, NB, dim=0).load(S2)        # D[n][rr, :] (zero from column rr on)
            t = gl.sum(arow[:, :, None] * Y, 1)
            Y = gl.where((r3 == rr)[None, :, None], Y - t[:, None, :], Y)
        Dinv = gl.reshape(Y, [BT, BT])
        dinv_s = gl.allocate_shared_memory(gl.float32, [BT, BT], F32)
        dinvt_s = gl.allocate_shared_memory(gl.float32, [BT, BT], F32)
        dinv_s.store(Dinv)
        dinvt_s.permute((1, 0)).store(Dinv)
        fence_async_shared()
        gl.thread_barrier()
        #    M = Dinv N; X = Dinv - M X three times from X = Dinv (tf32; -M stored, Dinv the accumulator)
        Mm = warpgroup_mma(dinv_s, nt_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, MF))
        Di = dinv_s.load(MF)
        m_s = gl.allocate_shared_memory(gl.float32, [BT, BT], F32)
        gl.thread_barrier()                         # every warp is done with N^T and Dinv (m_s may take their place)
        m_s.store(-Mm)
        fence_async_shared()
        gl.thread_barrier()
        X = warpgroup_mma(m_s, dinvt_s.permute((1, 0)), Di)
        xt_s = gl.allocate_shared_memory(gl.float32, [BT, BT], F32)
        for _ in gl.static_range(NB - 2):
            gl.thread_barrier()                     # every warp's wgmma is done with xt_s
            xt_s.permute((1, 0)).store(X)
            fence_async_shared()
            gl.thread_barrier()
            X = warpgroup_mma(m_s, xt_s.permute((1, 0)), Di)
        T = gl.convert_layout(X, M64, assert_trivial=True)
        _rows_store(TM, T, i64, j64, HV * BT, mr64)

        # 4. U = T (b v), W = T (b ks e^G): T a bf16 register operand; b v to bf16 in place (each thread its own
        #    copies: no barrier between)
        Tb = gl.convert_layout(T.to(gl.bfloat16), gl.DotOperandLayout(0, MV, 2))
        async_copy.wait_group(0)
        bP = gl.load(beta + iP * HV, mask=iP < L, other=0.0).to(gl.float32)[:, None]
        for s in gl.static_range(V // 64):
            v_s.index(s).store((bP * v_s.index(s).load(CPV).to(gl.float32)).to(gl.bfloat16))
        fence_async_shared()                        # b v visible to the wgmmas
        gl.thread_barrier()
        iU = gl.arange(0, BT, layout=gl.SliceLayout(1, MV))
        jU = gl.arange(0, 64, layout=gl.SliceLayout(0, MV))
        for s in gl.static_range(V // 64):
            u = warpgroup_mma(Tb, v_s.index(s), gl.zeros([BT, 64], gl.float32, MV))
            _rows_store(U + s * 64, u, iU, jU, HV * V, iU < L)
        TbK = gl.convert_layout(Tb, gl.DotOperandLayout(0, MK, 2), assert_trivial=True)
        iW = gl.arange(0, BT, layout=gl.SliceLayout(1, MK))
        jW = gl.arange(0, BK, layout=gl.SliceLayout(0, MK))
        for s in gl.static_range(NS):
            w = warpgroup_mma(TbK, kg_s.index(s), gl.zeros([BT, BK], gl.float32, MK))
            _rows_store(W + s * BK, w, iW, jW, HV * K, iW < L)
else:
    _kda_train_intra_fused_kernel = None
