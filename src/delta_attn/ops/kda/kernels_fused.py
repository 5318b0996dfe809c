"""Fused KDA inference forward (Gluon, Hopper sm_90): one warpgroup per (value head, sequence) keeps the transposed
state S^T [V, K] in wgmma accumulators across all of the sequence's chunks; nothing but the inputs, o and the
initial / final states touches HBM.

Per chunk of BT = 16 tokens (q, k L2-normalised when asked, the scale folded into q; G = the cumulative sum of
g in the chunk, Gl its last row):

0. cp.async brings chunk c + 2's raw q, k, v, g, beta into a two-stage ring;
1. Akk = strict_lower(beta_i (k e^G)(k e^-G)^T), Aqk = lower(q e^G (k e^-G)^T)        (mma_v2, bf16 operands);
2. T = (I + Akk)^-1 by block merging: 4x4 diagonal blocks exactly, then T <- T - T N T (mma_v2, tf32);
3. X^T = (beta v)^T - S^T (beta e^G k)^T and S^T (q e^G)^T                            (wgmma, S^T the A operand);
4. u^T = X^T T^T; o^T = S^T (q e^G)^T + u^T Aqk^T                                       (wgmma);
5. S^T = (S^T + u^T (k e^-G)) e^Gl                  (wgmma accumulating into the state, issued asynchronously).

Chunk c + 1's factors (steps 1-2 and the decayed tiles, in a two-stage factor ring) are built while chunk c's
state update runs. The decay work holds all 16 tokens of a channel in one warp, so the cumulative sum never
leaves it; the decays are powers of two by one MUFU.EX2 each (subnormals flush to zero).

The factored form e^G e^-G needs every |G| of the chunk within FACTOR_MAX. A chunk whose summed |g| per channel
exceeds it (strong or -inf decays) or is not finite (a NaN gate) has its factors zeroed (T = I, Gl = 0: steps 3-5
leave the state as it was) and is then redone exactly, token by token from the recurrence in fp32
(:func:`_exact_chunk`), its o rows overwriting the ones step 4 wrote.

Two forms, the same arithmetic bit for bit (``launch.fused_kernel`` chooses): :func:`_kda_fused_fwd_kernel`, one
warpgroup doing all of the above (two programs share an SM), and :func:`_kda_fused_ws_kernel`, warp-specialised: a
factor warpgroup runs steps 0-2 into the factor ring and the state's warpgroup steps 3-5, meeting at mbarriers (one
program per SM; for grids that leave SMs idle, where one warpgroup alone cannot hide a chunk's latency; launched at
WS_MAXNREG registers per thread, so that the g check's small reduction fits beside it).

Scope (``launch.fused_forward_unsupported`` says what is outside it): bf16 q, k, v, K = V = 128, log decays g
(no gate parameters), dense or packed sequences of any length, GVA, initial and final states.
"""
from __future__ import annotations

from .._gluon import gl, gluon

BT = 16          # tokens per chunk
WARPS = 4        # one warpgroup (8 warps: cross-warp sums and register spills, measured 2.2x slower)
FACTOR_REGS = 224  # the warp-specialised form's factor warpgroup (measured: 128 and 168 slower than 232)
WS_MAXNREG = 240   # its registers per thread at launch: 240 x 256 threads leave 4,096 of an SM's 65,536 for the g
                   # check's reduction beside it (ops/_decay_max.py); the state's warpgroup then takes 256

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _ex2(x):
        """2^x by one MUFU.EX2 (subnormal results flush to 0; gl.exp2 adds a range check and two multiplies)."""
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _mm_tf32(a, b, M2: gl.constexpr):
        """a @ b for two [BT, BT] fp32 tiles in the mma_v2 layout M2 (tf32 products, fp32 accumulation)."""
        return mma_v2(gl.convert_layout(a, gl.DotOperandLayout(0, M2, 1)),
                      gl.convert_layout(b, gl.DotOperandLayout(1, M2, 1)), gl.zeros_like(a), input_precision="tf32")

    @gluon.jit
    def _issue_chunk(q, k, v, g, beta, q_s, k_s, v_s, g_s, b_s, row, eos, HQ, HV, hq, h, K: gl.constexpr,
                     BT: gl.constexpr, CP: gl.constexpr, CG: gl.constexpr, CB: gl.constexpr, TAIL: gl.constexpr):
        """cp.async of one chunk's raw q, k, v (bf16), g (fp32) [BT, K] and beta [BT] into one stage of the ring;
        rows at or past the sequence end ``eos`` are zero-filled (a zero row adds nothing: beta 0, decay 1)."""
        r = row + gl.arange(0, BT, layout=gl.SliceLayout(1, CP))
        c = gl.arange(0, K, layout=gl.SliceLayout(0, CP))
        qk_off = (r[:, None] * HQ + hq) * K + c[None, :]
        v_off = (r[:, None] * HV + h) * K + c[None, :]
        rg = row + gl.arange(0, BT, layout=gl.SliceLayout(1, CG))
        cg = gl.arange(0, K, layout=gl.SliceLayout(0, CG))
        g_off = (rg[:, None] * HV + h) * K + cg[None, :]
        rb = row + gl.arange(0, BT, layout=CB)
        if TAIL:                                    # a chunk may end past the sequence
            m = (r < eos)[:, None] & (c < K)[None, :]
            async_copy.async_copy_global_to_shared(q_s, q + qk_off, mask=m)
            async_copy.async_copy_global_to_shared(k_s, k + qk_off, mask=m)
            async_copy.async_copy_global_to_shared(v_s, v + v_off, mask=m)
            async_copy.async_copy_global_to_shared(g_s, g + g_off, mask=(rg < eos)[:, None] & (cg < K)[None, :])
            async_copy.async_copy_global_to_shared(b_s, beta + rb * HV + h, mask=rb < eos)
        else:
            async_copy.async_copy_global_to_shared(q_s, q + qk_off)
            async_copy.async_copy_global_to_shared(k_s, k + qk_off)
            async_copy.async_copy_global_to_shared(v_s, v + v_off)
            async_copy.async_copy_global_to_shared(g_s, g + g_off)
            async_copy.async_copy_global_to_shared(b_s, beta + rb * HV + h)
        async_copy.commit_group()

    @gluon.jit
    def _prep(qr, kr, gr, br, kb_s, qg_s, kn_s, tt_s, aq_s, gl_s, scale, mi, mj, eye, FACTOR_MAX: gl.constexpr,
              L2NORM: gl.constexpr, BT: gl.constexpr, BL: gl.constexpr, CL: gl.constexpr, M2: gl.constexpr):
        """One chunk's factors from its raw tiles (one stage of the raw ring) into one stage of the factor ring:
        -(beta e^G k), q e^G, k e^-G (bf16 [BT, K]), T = (I + Akk)^-1 and Aqk (bf16 [BT, BT]), e^Gl ([K] fp32).
        Returns 1 when the chunk is redone exactly (its factors zeroed: T = I, e^Gl = 1), else 0."""
        # 0. the chunk's decay from in-thread column sums (a thread per channel); the factored form holds while
        #    every channel's summed |g| is within FACTOR_MAX (a NaN fails the test)
        gcol = gr.load(CL)
        exact = gl.max(gl.where(gl.sum(gl.abs(gcol), 0) <= FACTOR_MAX, 0, 1), 0)
        fast = exact == 0
        gl_s.store(gl.where(fast, _ex2(gl.sum(gcol, 0) * 1.4426950408889634), 1.0))
        qc = qr.load(BL).to(gl.float32)
        kc = kr.load(BL).to(gl.float32)
        gc = gl.where(fast, gr.load(BL) * 1.4426950408889634, 0.0)     # the decays in powers of two
        bc = br.load(gl.SliceLayout(1, BL))
        # 1. L2 norm of q and k, scale into q (both zero when the chunk is redone exactly)
        if L2NORM:
            rq = gl.rsqrt(gl.sum(qc * qc, 1) + 1e-6) * scale
            rk = gl.rsqrt(gl.sum(kc * kc, 1) + 1e-6)
        else:
            rq = gl.full([BT], 1.0, gl.float32, gl.SliceLayout(1, BL)) * scale
            rk = gl.full([BT], 1.0, gl.float32, gl.SliceLayout(1, BL))
        qc = qc * gl.where(fast, rq, 0.0)[:, None]
        kc = kc * gl.where(fast, rk, 0.0)[:, None]
        # 2. cumulative decay in the chunk; the decayed operands (bf16)
        G = gl.associative_scan(gc, 0, _add)
        eG = _ex2(G)
        kb_s.store((-(kc * eG) * bc[:, None]).to(gl.bfloat16))
        qg_s.store((qc * eG).to(gl.bfloat16))
        kn_s.store((kc * _ex2(-G)).to(gl.bfloat16))
        gl.thread_barrier()
        # 3. Akk = -(kb kn^T) (beta_i in kb), Aqk = qg kn^T (bf16 mma_v2), masked
        knT = kn_s.permute((1, 0)).load(gl.DotOperandLayout(1, M2, 2))
        zero2 = gl.zeros([BT, BT], gl.float32, M2)
        akk = mma_v2(kb_s.load(gl.DotOperandLayout(0, M2, 2)), knT, zero2)
        aqk = mma_v2(qg_s.load(gl.DotOperandLayout(0, M2, 2)), knT, zero2)
        akk = gl.where(mi[:, None] > mj[None, :], -akk, 0.0)
        aqk = gl.where(mi[:, None] >= mj[None, :], aqk, 0.0)
        # 4. T = (I + Akk)^-1 by block merging (tf32 mma_v2): the 4x4 diagonal blocks D exactly,
        #    (I + D)^-1 = (I - D)(I + D^2), then pairs of blocks joined, T <- T - T N T (N: the lower-left block of
        #    each pair of 4, then of 8). No power of Akk beyond a 4x4 block's square: stable for correlated keys,
        #    where the doubling product (I - A)(I + A^2)(I + A^4)(I + A^8) cancels terms of size C(14, 7) a^8
        d = gl.where(mi[:, None] // 4 == mj[None, :] // 4, akk, 0.0)
        tm = eye - d
        tm = tm + _mm_tf32(tm, _mm_tf32(d, d, M2), M2)
        for b in gl.static_range(2):
            n = gl.where((mi[:, None] // (8 << b) == mj[None, :] // (8 << b)) &
                         (mi[:, None] // (4 << b) != mj[None, :] // (4 << b)), akk, 0.0)
            tm = tm - _mm_tf32(_mm_tf32(tm, n, M2), tm, M2)
        tt_s.store(tm.to(gl.bfloat16))
        aq_s.store(aqk.to(gl.bfloat16))
        fence_async_shared()                        # visible to the wgmmas' async proxy (the caller's barrier follows)
        return exact

    @gluon.jit
    def _row(ptr, off, ok, N: gl.constexpr, W: gl.constexpr, DST: gl.constexpr):
        """N consecutive values at ``ptr + off`` as fp32 in layout DST (0 when not ``ok``), loaded one per thread
        (a compact pointer tensor) and then redistributed."""
        i = gl.arange(0, N, layout=gl.BlockedLayout([1], [32], [W], [0]))
        x = gl.load(ptr + off + i, mask=(i < N) & ok, other=0.0).to(gl.float32)
        return gl.convert_layout(x, DST)

    @gluon.jit
    def _exact_chunk(S0, S1, q, k, v, g, beta, o, row, eos, HQ, HV, hq, h, scale, K: gl.constexpr,
                     BT: gl.constexpr, W: gl.constexpr, SL: gl.constexpr, L2NORM: gl.constexpr):
        """The chunk's tokens one by one from the recurrence in fp32 (decay, delta rule, output), from the state
        halves S0 = S^T[:, :K/2], S1 = S^T[:, K/2:] the chunk starts from; o rows stored, the state returned."""
        KH: gl.constexpr = K // 2
        CV: gl.constexpr = gl.SliceLayout(0, SL)     # a row of S^T's K columns (one half)
        RV: gl.constexpr = gl.SliceLayout(1, SL)     # a column of S^T's V rows
        # the chunk's first row through an opaque move: no address of this rarely taken path becomes an induction
        # variable of the chunk loop (loop strength reduction would carry them, and their updates, on the fast path)
        row = gl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [row], dtype=gl.int64, is_pure=True, pack=1)
        for t in range(0, gl.minimum(eos - row, BT)):    # a run-time bound: not unrolled
            r = row + t
            ok = r < eos
            qk_off = (r * HQ + hq) * K
            v_off = (r * HV + h) * K
            # S <- Diag(exp(g_t)) S (the K columns of S^T)
            S0 = S0 * gl.exp(_row(g, v_off, ok, KH, W, CV))[None, :]
            S1 = S1 * gl.exp(_row(g, v_off + KH, ok, KH, W, CV))[None, :]
            # S <- S + beta k (v - S^T k)^T
            k0 = _row(k, qk_off, ok, KH, W, CV)
            k1 = _row(k, qk_off + KH, ok, KH, W, CV)
            if L2NORM:
                rk = gl.rsqrt(gl.sum(k0 * k0, 0) + gl.sum(k1 * k1, 0) + 1e-6)
                k0 = k0 * rk
                k1 = k1 * rk
            p = gl.sum(S0 * k0[None, :], 1) + gl.sum(S1 * k1[None, :], 1)
            d = (_row(v, v_off, ok, K, W, RV) - p) * gl.load(beta + r * HV + h, mask=ok, other=0.0)
            S0 = S0 + d[:, None] * k0[None, :]
            S1 = S1 + d[:, None] * k1[None, :]
            # o_t = S^T (scale q_t)
            q0 = _row(q, qk_off, ok, KH, W, CV)
            q1 = _row(q, qk_off + KH, ok, KH, W, CV)
            if L2NORM:
                rq = gl.rsqrt(gl.sum(q0 * q0, 0) + gl.sum(q1 * q1, 0) + 1e-6) * scale
            else:
                rq = scale
            ot = (gl.sum(S0 * q0[None, :], 1) + gl.sum(S1 * q1[None, :], 1)) * rq
            OL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
            oi = gl.arange(0, K, layout=OL)
            gl.store(o + v_off + oi, gl.convert_layout(ot, OL).to(o.dtype.element_ty), mask=(oi < K) & ok)
        return S0, S1

    @gluon.jit
    def _state_products(S0, S1, x, kb, qg, kn, tt, aq, o_s, K: gl.constexpr, BT: gl.constexpr, PL: gl.constexpr,
                        SL: gl.constexpr):
        """Steps 3-5 of one chunk from its factor stage (kb, qg, kn, tt, aq) and x = (beta v)^T [V, BT]: o^T to
        ``o_s`` (transposed), and the state update S^T + u^T (k e^-G) issued asynchronously (returned: nothing may
        touch the state until the caller's wait)."""
        KH: gl.constexpr = K // 2
        PA: gl.constexpr = gl.DotOperandLayout(0, PL, 2)      # register A operand of the [V, *] x [*, BT] wgmmas
        SA: gl.constexpr = gl.DotOperandLayout(0, SL, 2)      # register A operand of the state update
        # 3. the state products on the old state, by halves of K:
        #    X^T = (beta v)^T - S^T (beta e^G k)^T and (q e^G S)^T = S^T (q e^G)^T
        #    a half at a time (its bf16 copy pinned before the issue by an empty wait: ptxas serialises every
        #    wgmma of the kernel if a non-wgmma instruction touches wgmma registers while one is in flight)
        sa = gl.convert_layout(S0.to(gl.bfloat16), PA)
        sa = warpgroup_mma_wait(0, deps=[sa])
        x = warpgroup_mma(sa, kb.slice(0, KH, dim=1).permute((1, 0)), x, is_async=True)
        qs = warpgroup_mma(sa, qg.slice(0, KH, dim=1).permute((1, 0)), gl.zeros([K, BT], gl.float32, PL),
                           is_async=True)
        x, qs, sa = warpgroup_mma_wait(0, deps=[x, qs, sa])
        sa = gl.convert_layout(S1.to(gl.bfloat16), PA)
        sa = warpgroup_mma_wait(0, deps=[sa])
        x = warpgroup_mma(sa, kb.slice(KH, KH, dim=1).permute((1, 0)), x, is_async=True)
        qs = warpgroup_mma(sa, qg.slice(KH, KH, dim=1).permute((1, 0)), qs, is_async=True)
        x, qs, sa = warpgroup_mma_wait(0, deps=[x, qs, sa])
        # 4. u^T = X^T T^T; o^T = (q e^G S)^T + u^T Aqk^T, to shared memory transposed
        u = warpgroup_mma(gl.convert_layout(x.to(gl.bfloat16), PA), tt.permute((1, 0)),
                          gl.zeros([K, BT], gl.float32, PL))
        ub = u.to(gl.bfloat16)
        ot = warpgroup_mma(gl.convert_layout(ub, PA), aq.permute((1, 0)), qs)
        o_s.permute((1, 0)).store(ot.to(gl.bfloat16))
        # 5. S^T + u^T (k e^-G) issued asynchronously, by halves of K
        #    (pinning ua by an empty wait here, as sa above, makes ptxas serialise every wgmma)
        ua = gl.convert_layout(ub, SA)
        S0 = warpgroup_mma(ua, kn.slice(0, KH, dim=1), S0, is_async=True)
        S1 = warpgroup_mma(ua, kn.slice(KH, KH, dim=1), S1, is_async=True)
        return S0, S1

    @gluon.jit
    def _store_o(o, o_s, row, eos, HV, h, K: gl.constexpr, BT: gl.constexpr, CP: gl.constexpr, TAIL: gl.constexpr):
        """The chunk's o rows from ``o_s`` with 16-byte stores (rows at or past ``eos`` skipped)."""
        orow = row + gl.arange(0, BT, layout=gl.SliceLayout(1, CP))
        ocol = gl.arange(0, K, layout=gl.SliceLayout(0, CP))
        if TAIL:
            gl.store(o + (orow[:, None] * HV + h) * K + ocol[None, :], o_s.load(CP),
                     mask=(orow < eos)[:, None] & (ocol < K)[None, :])
        else:
            gl.store(o + (orow[:, None] * HV + h) * K + ocol[None, :], o_s.load(CP))

    @gluon.jit
    def _decayed(S0, S1, eGl, K: gl.constexpr, SL: gl.constexpr):
        """S^T e^Gl (the K columns of both halves), once the update has landed."""
        KH: gl.constexpr = K // 2
        S0, S1 = warpgroup_mma_wait(0, deps=[S0, S1])
        S0 = S0 * eGl.slice(0, KH).load(gl.SliceLayout(0, SL))[None, :]
        S1 = S1 * eGl.slice(KH, KH).load(gl.SliceLayout(0, SL))[None, :]
        return S0, S1

    # layouts (W warps): BL the [BT, K] decay-work tiles (a warp holds all BT tokens of K / W channels: the cumulative
    # sum over tokens stays in the warp); SL the two halves S^T[:, :K/2], S^T[:, K/2:] (wgmma accumulators [V, K/2]:
    # a half at a time goes to bf16 for the A operand, which keeps the register peak down); PL the [V, BT] products;
    # M2 the mma_v2 [BT, BT] products; CP / CG / CB the 16-byte cp.async copies; CL a thread per channel with all BT
    # tokens
    @gluon.constexpr_function
    def _bl(W):
        return gl.BlockedLayout([2, 8], [8, 4], [1, W], [1, 0])

    @gluon.constexpr_function
    def _sl(W, K):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, K // 2, 16])

    @gluon.constexpr_function
    def _pl(W, BT):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BT, 16])

    @gluon.constexpr_function
    def _m2(W):
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, W], instr_shape=[16, 8])

    @gluon.constexpr_function
    def _cp(W):
        return gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])

    @gluon.constexpr_function
    def _cg(W):
        return gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])

    @gluon.constexpr_function
    def _cb(W):
        return gl.BlockedLayout([1], [32], [W], [0])

    @gluon.constexpr_function
    def _cl(W, BT):
        return gl.BlockedLayout([BT, 1], [1, 32], [1, W], [0, 1])

    _KSH = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    _VSH = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))

    @gluon.jit
    def _rings(BT: gl.constexpr, K: gl.constexpr):
        """Both forms' shared memory: the two-stage ring of raw chunk inputs (cp.async) and the two-stage factor ring
        (K-wide operands [BT, K], B operands of the wgmmas read transposed and by halves of K, and the bf16 operands
        of Akk / Aqk; the [BT, BT] B operands; exp(Gl))."""
        GSH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        TSH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], _KSH)
        kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], _KSH)
        vr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], _KSH)
        gr_s = gl.allocate_shared_memory(gl.float32, [2, BT, K], GSH)
        br_s = gl.allocate_shared_memory(gl.float32, [2, BT], _VSH)
        kb_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], _KSH)  # -(beta e^G k)
        qg_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], _KSH)  # q e^G
        kn_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], _KSH)  # k e^-G
        tt_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BT], TSH)  # T
        aq_s = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BT], TSH)  # Aqk
        gl_s = gl.allocate_shared_memory(gl.float32, [2, K], _VSH)       # exp(Gl)
        return qr_s, kr_s, vr_s, gr_s, br_s, kb_s, qg_s, kn_s, tt_s, aq_s, gl_s

    @gluon.jit
    def _sequence(cu, T, VARLEN: gl.constexpr):
        """The program's sequence n and its token rows [bos, eos)."""
        n = gl.program_id(1).to(gl.int64)
        if VARLEN:
            bos = gl.load(cu + n).to(gl.int64)
            eos = gl.load(cu + n + 1).to(gl.int64)
        else:
            bos = n * T
            eos = bos + T
        return n, bos, eos

    @gluon.jit
    def _start_state(h0, n, HV, h, K: gl.constexpr, SL: gl.constexpr, HAS_H0: gl.constexpr):
        """S^T [V, K] as two halves (h0's or zeros) and their offsets in the (N, HV, K, V) fp32 states: S^T[v, c]
        at ((n HV + h) K + c) V + v."""
        KH: gl.constexpr = K // 2
        sv = gl.arange(0, K, layout=gl.SliceLayout(1, SL))
        sc = gl.arange(0, KH, layout=gl.SliceLayout(0, SL))
        s_off = (n * HV + h) * K * K + sc[None, :] * K + sv[:, None]
        if HAS_H0:
            S0 = gl.load(h0 + s_off)
            S1 = gl.load(h0 + s_off + KH * K)
            S0, S1 = warpgroup_mma_wait(0, deps=[S0, S1])          # pinned before the first wgmma (as below)
        else:
            S0 = gl.zeros([K, KH], gl.float32, SL)
            S1 = gl.zeros([K, KH], gl.float32, SL)
        return S0, S1, s_off

    @gluon.jit
    def _store_final(ht, S0, S1, s_off, K: gl.constexpr):
        S0, S1 = warpgroup_mma_wait(0, deps=[S0, S1])
        gl.store(ht + s_off, S0)
        gl.store(ht + s_off + (K // 2) * K, S1)

    @gluon.jit
    def _kda_fused_fwd_kernel(q, k, v, g, beta, o, cu, h0, ht, T, HQ, HV, GROUP, scale, K: gl.constexpr,
                              BT: gl.constexpr, W: gl.constexpr, FACTOR_MAX: gl.constexpr, L2NORM: gl.constexpr,
                              VARLEN: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
                              TAIL: gl.constexpr):
        h = gl.program_id(0)
        hq = h // GROUP
        n, bos, eos = _sequence(cu, T, VARLEN)
        L = eos - bos
        BL: gl.constexpr = _bl(W)
        SL: gl.constexpr = _sl(W, K)
        PL: gl.constexpr = _pl(W, BT)
        M2: gl.constexpr = _m2(W)
        CP: gl.constexpr = _cp(W)
        CG: gl.constexpr = _cg(W)
        CB: gl.constexpr = _cb(W)
        CL: gl.constexpr = _cl(W, BT)
        # shared memory: the rings (_rings); o, written transposed from o^T
        qr_s, kr_s, vr_s, gr_s, br_s, kb_s, qg_s, kn_s, tt_s, aq_s, gl_s = _rings(BT, K)
        o_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], _KSH)

        mi = gl.arange(0, BT, layout=gl.SliceLayout(1, M2))
        mj = gl.arange(0, BT, layout=gl.SliceLayout(0, M2))
        eye = gl.where(mi[:, None] == mj[None, :], 1.0, 0.0)
        S0, S1, s_off = _start_state(h0, n, HV, h, K, SL, HAS_H0)
        last = gl.maximum(((L - 1) // BT) * BT, 0)                  # the last chunk's first token
        # prologue: raw chunks 0 and 1 in flight, chunk 0's factors built
        _issue_chunk(q, k, v, g, beta, qr_s.index(0), kr_s.index(0), vr_s.index(0), gr_s.index(0), br_s.index(0),
                     bos, eos, HQ, HV, hq, h, K, BT, CP, CG, CB, TAIL)
        _issue_chunk(q, k, v, g, beta, qr_s.index(1), kr_s.index(1), vr_s.index(1), gr_s.index(1), br_s.index(1),
                     bos + gl.minimum(BT, last), eos, HQ, HV, hq, h, K, BT, CP, CG, CB, TAIL)
        async_copy.wait_group(1)
        gl.thread_barrier()
        exact = _prep(qr_s.index(0), kr_s.index(0), gr_s.index(0), br_s.index(0), kb_s.index(0), qg_s.index(0),
                      kn_s.index(0), tt_s.index(0), aq_s.index(0), gl_s.index(0), scale, mi, mj, eye, FACTOR_MAX,
                      L2NORM, BT, BL, CL, M2)
        gl.thread_barrier()
        for t0 in range(0, L, BT):
            st = ((t0 // BT) % 2).to(gl.int32)     # chunk c's raw and factor stage; 1 - st is chunk c + 1's
            kb = kb_s.index(st)
            qg = qg_s.index(st)
            kn = kn_s.index(st)
            # 3-5. the state products, o^T to o_s, the state update issued
            vT = vr_s.index(st).permute((1, 0)).load(PL).to(gl.float32)                   # v^T [V, BT]
            x = vT * br_s.index(st).load(gl.SliceLayout(0, PL))[None, :]
            S0, S1 = _state_products(S0, S1, x, kb, qg, kn, tt_s.index(st), aq_s.index(st), o_s, K, BT, PL, SL)
            # 0. chunk c's raw stage is free: chunk c + 2 into it; chunk c + 1's raw tiles have landed
            gl.thread_barrier()
            _issue_chunk(q, k, v, g, beta, qr_s.index(st), kr_s.index(st), vr_s.index(st), gr_s.index(st),
                         br_s.index(st), bos + gl.minimum(t0 + 2 * BT, last), eos, HQ, HV, hq, h, K, BT, CP, CG, CB,
                         TAIL)
            async_copy.wait_group(1)
            gl.thread_barrier()
            _store_o(o, o_s, bos + t0, eos, HV, h, K, BT, CP, TAIL)
            # 1-2. chunk c + 1's factors while the state update runs
            exact_next = _prep(qr_s.index(1 - st), kr_s.index(1 - st), gr_s.index(1 - st), br_s.index(1 - st),
                               kb_s.index(1 - st), qg_s.index(1 - st), kn_s.index(1 - st), tt_s.index(1 - st),
                               aq_s.index(1 - st), gl_s.index(1 - st), scale, mi, mj, eye, FACTOR_MAX, L2NORM,
                               BT, BL, CL, M2)
            # 5. S^T = (S^T + u^T (k e^-G)) e^Gl
            S0, S1 = _decayed(S0, S1, gl_s.index(st), K, SL)
            gl.thread_barrier()                     # chunk c + 1's factors complete; o_s read; o rows stored
            if exact != 0:                          # the chunk's state and o rows, exactly
                S0, S1 = _exact_chunk(S0, S1, q, k, v, g, beta, o, bos + t0, eos, HQ, HV, hq, h, scale, K, BT, W,
                                      SL, L2NORM)
            exact = exact_next
        async_copy.wait_group(0)                    # the last prefetch (a repeat of the last chunk) lands
        if STORE_FINAL:
            _store_final(ht, S0, S1, s_off, K)

    @gluon.jit
    def _ws_producer(q, k, v, g, beta, qr_s, kr_s, vr_s, gr_s, br_s, kb_s, qg_s, kn_s, tt_s, aq_s, gl_s, x_s, ex_s,
                     ready, empty, bos, eos, HQ, HV, hq, h, scale, K: gl.constexpr, BT: gl.constexpr,
                     W: gl.constexpr, FACTOR_MAX: gl.constexpr, L2NORM: gl.constexpr, TAIL: gl.constexpr):
        """The factor warpgroup: raw chunks two ahead (cp.async), then per chunk: wait until its factor stage is
        empty, build its factors (steps 1-2), (beta v) in fp32 and the exact-chunk flag into it, signal it ready."""
        BL: gl.constexpr = _bl(W)
        M2: gl.constexpr = _m2(W)
        CP: gl.constexpr = _cp(W)
        CG: gl.constexpr = _cg(W)
        CB: gl.constexpr = _cb(W)
        CL: gl.constexpr = _cl(W, BT)
        mi = gl.arange(0, BT, layout=gl.SliceLayout(1, M2))
        mj = gl.arange(0, BT, layout=gl.SliceLayout(0, M2))
        eye = gl.where(mi[:, None] == mj[None, :], 1.0, 0.0)
        last = gl.maximum(((eos - bos - 1) // BT) * BT, 0)          # the last chunk's first token
        _issue_chunk(q, k, v, g, beta, qr_s.index(0), kr_s.index(0), vr_s.index(0), gr_s.index(0), br_s.index(0),
                     bos, eos, HQ, HV, hq, h, K, BT, CP, CG, CB, TAIL)
        _issue_chunk(q, k, v, g, beta, qr_s.index(1), kr_s.index(1), vr_s.index(1), gr_s.index(1), br_s.index(1),
                     bos + gl.minimum(BT, last), eos, HQ, HV, hq, h, K, BT, CP, CG, CB, TAIL)
        for t0 in range(0, eos - bos, BT):
            c = (t0 // BT).to(gl.int32)
            st = c % 2
            async_copy.wait_group(1)                # chunk c's raw tiles have landed
            gl.thread_barrier()
            mbarrier.wait(empty.index(st), ((c // 2) & 1) ^ 1)      # (a fresh barrier's phase 1 counts as done)
            ex = _prep(qr_s.index(st), kr_s.index(st), gr_s.index(st), br_s.index(st), kb_s.index(st),
                       qg_s.index(st), kn_s.index(st), tt_s.index(st), aq_s.index(st), gl_s.index(st), scale, mi,
                       mj, eye, FACTOR_MAX, L2NORM, BT, BL, CL, M2)
            x_s.index(st).store(vr_s.index(st).load(BL).to(gl.float32) *
                                br_s.index(st).load(gl.SliceLayout(1, BL))[:, None])
            ex_s.index(st).store(gl.full([BT], 0, gl.int32, CB) + ex)
            fence_async_shared()
            gl.thread_barrier()                     # the stage complete; chunk c's raw stage read
            mbarrier.arrive(ready.index(st), count=1)
            _issue_chunk(q, k, v, g, beta, qr_s.index(st), kr_s.index(st), vr_s.index(st), gr_s.index(st),
                         br_s.index(st), bos + gl.minimum(t0 + 2 * BT, last), eos, HQ, HV, hq, h, K, BT, CP, CG, CB,
                         TAIL)
        async_copy.wait_group(0)                    # the last prefetches (repeats of the last chunk) land

    @gluon.jit
    def _ws_state(q, k, v, g, beta, o, h0, ht, kb_s, qg_s, kn_s, tt_s, aq_s, gl_s, x_s, ex_s, o_s, ready, empty, n,
                  bos, eos, HQ, HV, hq, h, scale, K: gl.constexpr, BT: gl.constexpr, W: gl.constexpr,
                  L2NORM: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr, TAIL: gl.constexpr):
        """The state's warpgroup: per chunk, wait for its factor stage, steps 3-5, o rows stored, the stage
        signalled empty; a flagged chunk then redone exactly."""
        SL: gl.constexpr = _sl(W, K)
        PL: gl.constexpr = _pl(W, BT)
        CP: gl.constexpr = _cp(W)
        CB: gl.constexpr = _cb(W)
        S0, S1, s_off = _start_state(h0, n, HV, h, K, SL, HAS_H0)
        for t0 in range(0, eos - bos, BT):
            c = (t0 // BT).to(gl.int32)
            st = c % 2
            mbarrier.wait(ready.index(st), (c // 2) & 1)
            S0, S1 = _state_products(S0, S1, x_s.index(st).permute((1, 0)).load(PL), kb_s.index(st),
                                     qg_s.index(st), kn_s.index(st), tt_s.index(st), aq_s.index(st), o_s, K, BT,
                                     PL, SL)
            gl.thread_barrier()                     # o_s written by every thread
            _store_o(o, o_s, bos + t0, eos, HV, h, K, BT, CP, TAIL)
            S0, S1 = _decayed(S0, S1, gl_s.index(st), K, SL)
            exact = gl.max(ex_s.index(st).load(CB), 0)
            gl.thread_barrier()                     # the stage and o_s read by every thread
            mbarrier.arrive(empty.index(st), count=1)
            if exact != 0:                          # the chunk's state and o rows, exactly
                S0, S1 = _exact_chunk(S0, S1, q, k, v, g, beta, o, bos + t0, eos, HQ, HV, hq, h, scale, K, BT, W,
                                      SL, L2NORM)
        if STORE_FINAL:
            _store_final(ht, S0, S1, s_off, K)

    @gluon.jit
    def _kda_fused_ws_kernel(q, k, v, g, beta, o, cu, h0, ht, T, HQ, HV, GROUP, scale, K: gl.constexpr,
                             BT: gl.constexpr, W: gl.constexpr, FACTOR_MAX: gl.constexpr, L2NORM: gl.constexpr,
                             VARLEN: gl.constexpr, HAS_H0: gl.constexpr, STORE_FINAL: gl.constexpr,
                             TAIL: gl.constexpr, FACTOR_REGS: gl.constexpr):
        """The same forward with a second warpgroup building the factors: its warp-specialised form, for grids of
        at most one (sequence, head) per SM, where one warpgroup alone cannot hide its chunk's latency
        (``launch.fused_forward``). The factor warpgroup (``_ws_producer``, FACTOR_REGS registers) and the state's
        (``_ws_state``) pass each chunk's factors through a two-stage ring in shared memory, signalled by mbarriers
        (ready: factors built; empty: consumed); (beta v) goes with them in fp32, so the state's warpgroup reads
        no raw input."""
        h = gl.program_id(0)
        hq = h // GROUP
        n, bos, eos = _sequence(cu, T, VARLEN)
        qr_s, kr_s, vr_s, gr_s, br_s, kb_s, qg_s, kn_s, tt_s, aq_s, gl_s = _rings(BT, K)
        x_s = gl.allocate_shared_memory(gl.float32, [2, BT, K], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))  # beta v
        ex_s = gl.allocate_shared_memory(gl.int32, [2, BT], _VSH)       # the exact-chunk flag
        o_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], _KSH)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_ws_state, (q, k, v, g, beta, o, h0, ht, kb_s, qg_s, kn_s, tt_s, aq_s, gl_s, x_s, ex_s, o_s, ready,
                         empty, n, bos, eos, HQ, HV, hq, h, scale, K, BT, W, L2NORM, HAS_H0, STORE_FINAL, TAIL)),
            (_ws_producer, (q, k, v, g, beta, qr_s, kr_s, vr_s, gr_s, br_s, kb_s, qg_s, kn_s, tt_s, aq_s, gl_s, x_s,
                            ex_s, ready, empty, bos, eos, HQ, HV, hq, h, scale, K, BT, W, FACTOR_MAX, L2NORM,
                            TAIL)),
        ], [W], [FACTOR_REGS])
else:
    _kda_fused_fwd_kernel = None
    _kda_fused_ws_kernel = None
