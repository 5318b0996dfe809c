"""Reverse state scan of KDA training (Gluon, Hopper sm_90): the ``_kda_bwd_scan_kernel`` of ``kernels_backward.py``
for bf16 operands, K = V = 128, 64-token chunks, with the transposed state gradient dS^T [BV, K] held in wgmma
accumulators across the sequence's chunks. Same inputs, same outputs (du per token, every chunk-end dS, dS at the
sequence start), one program per (V block, sequence, value head), one warpgroup per 64 value rows
(``launch.scan_fused_tiles`` picks V blocks of 64 or the whole V by the number of chains).

Per chunk c, from the last to the first (dS the gradient of the state at the chunk's end; kd, qg, W [BT, K], Aqk
[BT, BT], dO [BT, BV] the chunk's operands, gc = exp(G_last) [K]):

0. cp.async brings chunk c - STAGES's operands into the stage chunk c freed (a ring of STAGES = 1 or 2);
1. dS (bf16) stored as the chunk-end state gradient, through shared memory (coalesced rows of V);
2. du^T = dO^T Aqk + dS^T kd^T                                        (wgmma, dS^T the register A operand);
3. dS^T <- dS^T diag(gc) + dO^T qg, issued with step 2 (the products do not depend on du);
4. du stored; dS^T <- dS^T - du^T W                                    (wgmma, -du^T the register A operand).

The products take bf16 operands with fp32 accumulation, as the Triton kernel's for bf16 (dS and du rounded to bf16
where they enter a product, dS^T kept in fp32). The state is kept in two halves of K (a half at a time goes to
bf16 for the A operand, which keeps the register peak down), as ``kernels_fused.py`` does for the forward's.

Scope (``launch._bwd_scan_fused_unsupported`` says what is outside it): bf16 work dtype, K = V = 128.
"""
from __future__ import annotations

from .._gluon import gl, gluon

BT = 64          # tokens per chunk (the training chunk)
ROWS = 64        # value rows of dS^T (or S^T) per warpgroup: the wgmma's M

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from .kernels_backward_gluon import _in_loop

    @gluon.constexpr_function
    def _copy_layout(cols, warps):
        """Rows of ``cols`` 16-bit values in 16-byte pieces over a warpgroup (the cp.async copies and row stores)."""
        return gl.BlockedLayout([1, 8], [32 // (cols // 8), cols // 8], [warps, 1], [1, 0])

    @gluon.jit
    def _chain(seq_info, BV: gl.constexpr, BT: gl.constexpr):
        """A scan program's chain: its V block's first column, the sequence, the value head, the sequence's first
        packed row, length, first chunk and chunk count."""
        v0 = gl.program_id(0) * BV
        n = gl.program_id(1).to(gl.int64)
        hv = gl.program_id(2).to(gl.int64)
        row0 = gl.load(seq_info + n * 3).to(gl.int64)
        Tn = gl.load(seq_info + n * 3 + 1)
        cbase = gl.load(seq_info + n * 3 + 2).to(gl.int64)
        return v0, n, hv, row0, Tn, cbase, gl.cdiv(Tn, BT)

    @gluon.jit
    def _issue_chunk(W, QG, KD, AQK, X, w_s, qg_s, kd_s, aq_s, x_s, row, rows, HV, hv, v0, K: gl.constexpr,
                     V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, NW: gl.constexpr):
        """cp.async of one chunk's W, qg, kd [BT, K], Aqk [BT, BT] and X's columns [v0, v0 + BV) (dO for the reverse
        scan, U for the forward one) into one stage of the ring: the chunk's ``rows`` rows from packed row ``row``;
        the rest zero-filled (they add nothing)."""
        CK: gl.constexpr = _copy_layout(K, NW)
        CA: gl.constexpr = _copy_layout(BT, NW)
        CV: gl.constexpr = _copy_layout(BV, NW)
        i = gl.arange(0, BT, layout=gl.SliceLayout(1, CK))
        j = gl.arange(0, K, layout=gl.SliceLayout(0, CK))
        m = (i < rows)[:, None] & (j < K)[None, :]
        k_off = ((row + i)[:, None] * HV + hv) * K + j[None, :]
        async_copy.async_copy_global_to_shared(w_s, W + k_off, mask=m)
        async_copy.async_copy_global_to_shared(qg_s, QG + k_off, mask=m)
        async_copy.async_copy_global_to_shared(kd_s, KD + k_off, mask=m)
        ia = gl.arange(0, BT, layout=gl.SliceLayout(1, CA))
        ja = gl.arange(0, BT, layout=gl.SliceLayout(0, CA))
        async_copy.async_copy_global_to_shared(aq_s, AQK + ((row + ia)[:, None] * HV + hv) * BT + ja[None, :],
                                               mask=(ia < rows)[:, None] & (ja < BT)[None, :])
        iv = gl.arange(0, BT, layout=gl.SliceLayout(1, CV))
        jv = gl.arange(0, BV, layout=gl.SliceLayout(0, CV))
        async_copy.async_copy_global_to_shared(x_s, X + ((row + iv)[:, None] * HV + hv) * V + v0 + jv[None, :],
                                               mask=(iv < rows)[:, None] & (jv < BV)[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _kda_bwd_scan_fused_kernel(W, QG, KD, AQK, GC, DO, dht, seq_info, DU, DH0, DH, HV,
                                   K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                                   USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr, STAGES: gl.constexpr,
                                   NW: gl.constexpr):
        v0, n, hv, row0, Tn, cbase, nc = _chain(seq_info, BV, BT)
        KH: gl.constexpr = K // 2
        # layouts: SL the halves dS^T[:, :K/2], dS^T[:, K/2:] (wgmma accumulators [BV, K/2]); PL du^T [BV, BT];
        # PA / SA their register A operands; CV the 16-byte rows of the [K, BV] state-gradient store
        SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, KH, 16])
        PL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BT, 16])
        PA: gl.constexpr = gl.DotOperandLayout(0, PL, 2)
        SA: gl.constexpr = gl.DotOperandLayout(0, SL, 2)
        CV: gl.constexpr = _copy_layout(BV, NW)
        # shared memory: the operand ring (STAGES deep: 2 prefetches chunk c - 1 during chunk c, for a program alone
        # on its SM; 1 leaves room for two programs per SM, which hide each other's loads); the staging tile of the
        # chunk-end state-gradient store (coalesced rows)
        HSH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        w_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], HSH)
        qg_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], HSH)
        kd_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], HSH)
        aq_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], HSH)
        do_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], HSH)
        dh_s = gl.allocate_shared_memory(gl.bfloat16, [K, BV], HSH)

        # dS^T [BV, K] as two halves; (N, HV, K, V) gradients: dS[k, v] at ((n HV + hv) K + k) V + v
        sv = v0 + gl.arange(0, BV, layout=gl.SliceLayout(1, SL))
        sc = gl.arange(0, KH, layout=gl.SliceLayout(0, SL))
        s_off = sc[None, :] * V + sv[:, None]
        st_off = (n * HV + hv) * K * V
        if USE_DHT:
            D0 = gl.load(dht + st_off + s_off).to(gl.float32)
            D1 = gl.load(dht + st_off + s_off + KH * V).to(gl.float32)
            D0, D1 = warpgroup_mma_wait(0, deps=[D0, D1])          # pinned before the first wgmma
        else:
            D0 = gl.zeros([BV, KH], gl.float32, SL)
            D1 = gl.zeros([BV, KH], gl.float32, SL)
        # prologue: the last STAGES chunks in flight
        for p in gl.static_range(STAGES):
            cp = gl.maximum(nc - 1 - p, 0)
            _issue_chunk(W, QG, KD, AQK, DO, w_s.index(p), qg_s.index(p), kd_s.index(p), aq_s.index(p),
                         do_s.index(p), row0 + cp * BT, gl.minimum(Tn - cp * BT, BT), HV, hv, v0, K, V, BT, BV, NW)
        ks = gl.arange(0, K, layout=gl.SliceLayout(1, CV))
        vs = gl.arange(0, BV, layout=gl.SliceLayout(0, CV))
        ju = gl.arange(0, BT, layout=gl.SliceLayout(0, PL))       # du^T's columns: the chunk's tokens
        iu = v0 + gl.arange(0, BV, layout=gl.SliceLayout(1, PL))  # du^T's rows: the values
        for cc in range(0, nc):
            c = nc - 1 - cc
            st = (cc % STAGES).to(gl.int32)
            rows = gl.minimum(Tn - c * BT, BT)
            async_copy.wait_group(STAGES - 1)       # chunk c's operands have landed
            fence_async_shared()                    # visible to the wgmmas' async proxy
            gl.thread_barrier()
            # 1. the chunk-end state gradient, bf16, as rows of V
            dh_s.slice(0, KH, dim=0).permute((1, 0)).store(D0.to(gl.bfloat16))
            dh_s.slice(KH, KH, dim=0).permute((1, 0)).store(D1.to(gl.bfloat16))
            # 2-3. du^T = dO^T Aqk + dS^T kd^T; dS^T diag(gc) + dO^T qg (the halves' bf16 copies and the scaled
            #      halves pinned before the issue: ptxas serialises every wgmma if a non-wgmma instruction touches
            #      the registers of a wgmma in flight)
            sa0 = gl.convert_layout(D0.to(gl.bfloat16), PA)
            sa1 = gl.convert_layout(D1.to(gl.bfloat16), PA)
            gcb = GC + ((cbase + c) * HV + hv) * K
            D0 = D0 * gl.load(gcb + sc)[None, :]
            D1 = D1 * gl.load(gcb + KH + sc)[None, :]
            sa0, sa1, D0, D1 = warpgroup_mma_wait(0, deps=[sa0, sa1, D0, D1])
            doT = do_s.index(st).permute((1, 0))
            kd = kd_s.index(st)
            qg = qg_s.index(st)
            du = warpgroup_mma(doT, aq_s.index(st), gl.zeros([BV, BT], gl.float32, PL), is_async=True)
            du = warpgroup_mma(sa0, kd.slice(0, KH, dim=1).permute((1, 0)), du, is_async=True)
            du = warpgroup_mma(sa1, kd.slice(KH, KH, dim=1).permute((1, 0)), du, is_async=True)
            D0 = warpgroup_mma(doT, qg.slice(0, KH, dim=1), D0, is_async=True)
            D1 = warpgroup_mma(doT, qg.slice(KH, KH, dim=1), D1, is_async=True)
            gl.thread_barrier()                     # dh_s written by every thread
            hvl = _in_loop(HV, c)                   # the row stride, formed in the loop: no address tile hoisted
            gl.store(DH + ((cbase + c) * hvl + hv) * K * V + ks[:, None] * V + v0 + vs[None, :], dh_s.load(CV))
            du, D0, D1, sa0, sa1 = warpgroup_mma_wait(0, deps=[du, D0, D1, sa0, sa1])
            # 4. du rows, stored from du^T's registers (8 consecutive values of a token per 32-byte sector);
            #    dS^T - du^T W
            gl.store(DU + ((row0 + c * BT + ju)[None, :] * hvl + hv) * V + iu[:, None], du.to(DU.dtype.element_ty),
                     mask=(ju < rows)[None, :] & (iu < V)[:, None])
            ua = gl.convert_layout((-du).to(gl.bfloat16), SA)
            w = w_s.index(st)
            D0 = warpgroup_mma(ua, w.slice(0, KH, dim=1), D0, is_async=True)
            D1 = warpgroup_mma(ua, w.slice(KH, KH, dim=1), D1, is_async=True)
            D0, D1 = warpgroup_mma_wait(0, deps=[D0, D1])
            # 0. chunk c's stage is free (its wgmmas done, dh_s read): chunk c - STAGES into it
            gl.thread_barrier()
            cn = gl.maximum(c - STAGES, 0)
            _issue_chunk(W, QG, KD, AQK, DO, w_s.index(st), qg_s.index(st), kd_s.index(st), aq_s.index(st),
                         do_s.index(st), row0 + cn * BT, gl.minimum(Tn - cn * BT, BT), HV, hv, v0, K, V, BT, BV,
                         NW)
        async_copy.wait_group(0)                    # the last prefetches (repeats of chunk 0) land
        if STORE_DH0:
            gl.store(DH0 + st_off + s_off, D0)
            gl.store(DH0 + st_off + s_off + KH * V, D1)
    @gluon.jit
    def _kda_fwd_scan_fused_kernel(W, U, QG, KD, AQK, GC, h0, seq_info, O, VNEW, HS, HT, HV,
                                   K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr,
                                   USE_H0: gl.constexpr, STORE_FINAL: gl.constexpr, STORE_H: gl.constexpr,
                                   STAGES: gl.constexpr, NW: gl.constexpr):
        """The forward state scan (``kernels_scan._kda_fwd_scan_kernel`` without TRANSITION), S^T [BV, K] in wgmma
        accumulators: per chunk, the chunk-start state stored (STORE_H), u^T = U^T - S^T W^T and (qg S)^T = S^T qg^T
        (one async group), u stored (STORE_H), o^T = (qg S)^T + u^T Aqk^T, S^T <- S^T diag(gc) + u^T kd."""
        v0, n, hv, row0, Tn, cbase, nc = _chain(seq_info, BV, BT)
        KH: gl.constexpr = K // 2
        SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, KH, 16])
        PL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BT, 16])
        PA: gl.constexpr = gl.DotOperandLayout(0, PL, 2)
        SA: gl.constexpr = gl.DotOperandLayout(0, SL, 2)
        CV: gl.constexpr = _copy_layout(BV, NW)
        HSH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        w_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], HSH)
        qg_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], HSH)
        kd_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, K], HSH)
        aq_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BT], HSH)
        u_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BV], HSH)
        hs_s = gl.allocate_shared_memory(gl.bfloat16, [K, BV], HSH)        # the chunk-start state (STORE_H)
        o_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], HSH)        # o, written transposed from o^T

        sv = v0 + gl.arange(0, BV, layout=gl.SliceLayout(1, SL))
        sc = gl.arange(0, KH, layout=gl.SliceLayout(0, SL))
        s_off = sc[None, :] * V + sv[:, None]
        st_off = (n * HV + hv) * K * V
        if USE_H0:
            S0 = gl.load(h0 + st_off + s_off).to(gl.float32)
            S1 = gl.load(h0 + st_off + s_off + KH * V).to(gl.float32)
            S0, S1 = warpgroup_mma_wait(0, deps=[S0, S1])
        else:
            S0 = gl.zeros([BV, KH], gl.float32, SL)
            S1 = gl.zeros([BV, KH], gl.float32, SL)
        for p in gl.static_range(STAGES):
            cp = gl.minimum(p, gl.maximum(nc - 1, 0))
            _issue_chunk(W, QG, KD, AQK, U, w_s.index(p), qg_s.index(p), kd_s.index(p), aq_s.index(p),
                         u_s.index(p), row0 + cp * BT, gl.minimum(Tn - cp * BT, BT), HV, hv, v0, K, V, BT, BV,
                             NW)
        ks = gl.arange(0, K, layout=gl.SliceLayout(1, CV))
        vs = gl.arange(0, BV, layout=gl.SliceLayout(0, CV))
        it = gl.arange(0, BT, layout=gl.SliceLayout(1, CV))
        ju = gl.arange(0, BT, layout=gl.SliceLayout(0, PL))       # u^T's columns: the chunk's tokens
        iu = v0 + gl.arange(0, BV, layout=gl.SliceLayout(1, PL))  # u^T's rows: the values
        for c in range(0, nc):
            st = (c % STAGES).to(gl.int32)
            rows = gl.minimum(Tn - c * BT, BT)
            async_copy.wait_group(STAGES - 1)       # chunk c's operands have landed
            fence_async_shared()                    # visible to the wgmmas' async proxy
            gl.thread_barrier()
            if STORE_H:                             # the chunk-start state, bf16, as rows of V
                hs_s.slice(0, KH, dim=0).permute((1, 0)).store(S0.to(gl.bfloat16))
                hs_s.slice(KH, KH, dim=0).permute((1, 0)).store(S1.to(gl.bfloat16))
            # (W S)^T = S^T W^T by halves of K (bf16 copies pinned before the issue), then u, then
            # o^T = S^T qg^T + u^T Aqk^T: one [BV, BT] accumulator live at a time
            sa0 = gl.convert_layout(S0.to(gl.bfloat16), PA)
            sa1 = gl.convert_layout(S1.to(gl.bfloat16), PA)
            sa0, sa1 = warpgroup_mma_wait(0, deps=[sa0, sa1])
            w = w_s.index(st)
            qg = qg_s.index(st)
            zero = gl.zeros([BV, BT], gl.float32, PL)
            x = warpgroup_mma(sa0, w.slice(0, KH, dim=1).permute((1, 0)), zero, is_async=True)
            x = warpgroup_mma(sa1, w.slice(KH, KH, dim=1).permute((1, 0)), x, is_async=True)
            hvl = _in_loop(HV, c)                   # the row stride, formed in the loop: no address tile hoisted
            if STORE_H:
                gl.thread_barrier()                 # hs_s written by every thread
                gl.store(HS + ((cbase + c) * hvl + hv) * K * V + ks[:, None] * V + v0 + vs[None, :], hs_s.load(CV))
            x, sa0, sa1 = warpgroup_mma_wait(0, deps=[x, sa0, sa1])
            # u^T = U^T - (W S)^T (u rounded to bf16 where it is stored and enters a product, as the Triton kernel)
            ub = (u_s.index(st).permute((1, 0)).load(PL).to(gl.float32) - x).to(gl.bfloat16)
            if STORE_H:
                gl.store(VNEW + ((row0 + c * BT + ju)[None, :] * hvl + hv) * V + iu[:, None], ub,
                         mask=(ju < rows)[None, :] & (iu < V)[:, None])
            ot = warpgroup_mma(sa0, qg.slice(0, KH, dim=1).permute((1, 0)), zero, is_async=True)
            ot = warpgroup_mma(sa1, qg.slice(KH, KH, dim=1).permute((1, 0)), ot, is_async=True)
            ot = warpgroup_mma(gl.convert_layout(ub, PA), aq_s.index(st).permute((1, 0)), ot, is_async=True)
            ot, sa0, sa1 = warpgroup_mma_wait(0, deps=[ot, sa0, sa1])
            o_s.permute((1, 0)).store(ot.to(gl.bfloat16))
            # S^T <- S^T diag(gc) + u^T kd, issued asynchronously by halves of K
            gcb = GC + ((cbase + c) * HV + hv) * K
            S0 = S0 * gl.load(gcb + sc)[None, :]
            S1 = S1 * gl.load(gcb + KH + sc)[None, :]
            ua = gl.convert_layout(ub, SA)
            kd = kd_s.index(st)
            S0 = warpgroup_mma(ua, kd.slice(0, KH, dim=1), S0, is_async=True)
            S1 = warpgroup_mma(ua, kd.slice(KH, KH, dim=1), S1, is_async=True)
            gl.thread_barrier()                     # o_s written by every thread
            r = row0 + c * BT + it
            gl.store(O + (r[:, None] * hvl + hv) * V + v0 + vs[None, :], o_s.load(CV).to(O.dtype.element_ty),
                     mask=(it < rows)[:, None] & (vs < BV)[None, :])
            S0, S1 = warpgroup_mma_wait(0, deps=[S0, S1])
            # chunk c's stage is free (its wgmmas done, o_s / hs_s read): chunk c + STAGES into it
            gl.thread_barrier()
            cn = gl.minimum(c + STAGES, gl.maximum(nc - 1, 0))
            _issue_chunk(W, QG, KD, AQK, U, w_s.index(st), qg_s.index(st), kd_s.index(st), aq_s.index(st),
                         u_s.index(st), row0 + cn * BT, gl.minimum(Tn - cn * BT, BT), HV, hv, v0, K, V, BT, BV,
                             NW)
        async_copy.wait_group(0)                    # the last prefetches (repeats of the last chunk) land
        if STORE_FINAL:
            gl.store(HT + st_off + s_off, S0)
            gl.store(HT + st_off + s_off + KH * V, S1)
else:
    _kda_bwd_scan_fused_kernel = None
    _kda_fwd_scan_fused_kernel = None
