"""``backend="triton"`` for KDA: launchers (``kda_fwd`` / ``kda_bwd`` / ``kda_step_fwd``), the
autograd ``KDAFunction`` and the ``torch.library`` custom ops (with fake implementations) they run.

Kernels: ``chunk.py`` (chunked forward / backward, 16-token chunks), ``chunk64.py`` (64-token chunks),
``prep_lean.py`` (the prep of the forward without gradient, ``CONFIG["fwd_variant"]``), ``recurrent.py`` (decode).
"""
from __future__ import annotations

import functools
import os
from typing import List, Optional, Tuple

import torch
import triton

from ..._outputs import empty
from ...backends import sm_count
from .api import KDAArgs
from .chunk import (DECAY_FLOOR, _kda_bwd_intra_kernel, _kda_bwd_scan_kernel, _kda_fwd_prep_kernel,
                    _kda_fwd_scan_kernel)
from .chunk64 import _kda_bwd_chunk_grads_kernel, _kda_bwd_intra64_kernel, _kda_fwd_prep64_kernel
from .prep_lean import _kda_fwd_prep_lean_kernel
from .recurrent import _kda_step_kernel

BT = 16          # chunk length (tokens): the intra-chunk blocks are exact per-channel pairwise products
BT64 = 64        # chunk length of the 64-token paths (4 sub-chunks of 16): training by default


def _gate_mode(A_log, lower_bound) -> int:
    if A_log is None:
        return 0
    return 1 if lower_bound is None else 2


def _index_tables(B: int, T: int, cu_seqlens: Optional[torch.Tensor], device, BT: int = BT):
    """seq_info (N, 3) = (first row, length, first chunk); chunk_info (NC, 3) = (seq, first row, length)
    for chunks of BT tokens."""
    if cu_seqlens is None:
        starts = torch.arange(B, dtype=torch.int64) * T
        lens = torch.full((B,), T, dtype=torch.int64)
    else:
        cu = cu_seqlens.to("cpu", torch.int64)
        starts, lens = cu[:-1], cu[1:] - cu[:-1]
    nch = (lens + BT - 1) // BT
    first = torch.cumsum(nch, 0) - nch
    seq_t = torch.stack([starts, lens, first], 1)
    seq_id = torch.repeat_interleave(torch.arange(len(lens)), nch)
    local = torch.arange(int(nch.sum())) - first[seq_id]
    t0 = starts[seq_id] + local * BT
    chunk_t = torch.stack([seq_id, t0, torch.clamp(lens[seq_id] - local * BT, max=BT)], 1)
    ncmax = int(nch.max()) if len(nch) else 0
    return seq_t.to(torch.int32).to(device), chunk_t.to(torch.int32).to(device), ncmax


def _pow2(x: int) -> int:
    return triton.next_power_of_2(x)


# Launch settings (the benchmark's --tune pass edits these). Measured on an H200 (benchmarks/results/
# kda_h200.md): prep_warps 4 -> 8 made the forward 1.6x slower; decode: step_bv 64 / step_warps 4 the fastest of
# step_bv {16, 32, 64} x step_warps {1, 2, 4, 8} (run 6: 42.5 us eager, 3.16 TB/s; 32 / 2 was 43.7 us).
# factor_max: per chunk, the factored exp(G_i) exp(-G_j) when every |G| <= it (fp32-safe), else the
# exact pairwise form. save_intermediates: the eager forward keeps what the backward needs.
# fwd_chunk: 16 (default, measured faster at 8x4096) or 64 (opt-in: the 64-token path of chunk64.py
# for forwards without gradient; env DELTA_ATTN_KDA_FWD_CHUNK); prep64_*: its prep kernel (K slice,
# K slice of the exact pairwise diagonal blocks, warps), scan64_*: its scan. The 64-token
# warps: measured on the H200 (kda_h200.md, 02:48 UTC run): 4 warps beat 8 for prep64 (fwd64 3.45 -> 2.40 ms
# at 8x4096, 4.26 -> 3.27 at 1x32768) and for the scan (-0.17 / -0.33 ms), although ptxas -v reports
# spills at 4 warps (prep64 ~2.3 KB, scan ~0.5-1.8 KB per thread) and few at 8.
# train_chunk: 64 (default: measured faster on the H200 at 8x4096 and 1x32768, kda_h200.md) or 16: the
# chunk length of the forward that keeps the backward's intermediates and of that backward (env
# DELTA_ATTN_KDA_TRAIN_CHUNK); bwd_scan64_* / bwd64_* / intra64_*: its kernels (intra64_warps 4 measured
# faster than 8 with the strong-decay code compiled in: 10.0 vs 12.6 ms fwd+bwd at 8x4096);
# bwd64_split: its reverse scan stores only du and the chunk-end state gradients, and the partial
# gradients of the scan's operands come from a parallel kernel over the full V (grads64_*), instead of
# per-V-block fp32 partials formed inside the sequential loop (ptxas -v, sm_90a, 8 warps: the scan without
# partials spills 0 / 32 B at BV 32 / 64; the grads kernel 80 B at BK 128, BV 32, 8 warps, 0.5-3 KB at BK 64).
def _env_int(name: str, default: int) -> int:
    """An integer setting from the environment; a bad value is an error that names the variable."""
    raw = os.environ.get(name, "") or str(default)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


CONFIG = dict(prep_bk=16, prep_warps=4, scan_warps=4, scan_stages=3, bwd_scan_warps=8, intra_bk=16,
              intra_warps=8, step_bv=64, step_warps=4, min_programs=256, bwd_min_programs=64,
              factor_max=60.0, save_intermediates=True,
              fwd_chunk=_env_int("DELTA_ATTN_KDA_FWD_CHUNK", 16),
              prep64_bk=32, prep64_bkd=4, prep64_warps=4, scan64_warps=4, scan64_stages=2,
              scan64_min_programs=256,
              train_chunk=_env_int("DELTA_ATTN_KDA_TRAIN_CHUNK", 64),
              bwd_scan64_warps=8, bwd64_min_programs=64, intra64_bk=16, intra64_warps=4, intra64_round_tf32=False,
              bwd64_split=True, grads64_bk=128, grads64_bv=32, grads64_warps=8,
              fwd_variant=os.environ.get("DELTA_ATTN_KDA_FWD_VARIANT", "lean_dots") or "lean_dots",
              lean_ks=32, lean_warps=4, lean_stages=1, lean_inv_prec=None,
              lean_chunk=_env_int("DELTA_ATTN_KDA_LEAN_CHUNK", 0))
FWD_CHUNKS = (16, 64)
# fwd_variant (env DELTA_ATTN_KDA_FWD_VARIANT): the prep of the forward without gradient.
# "lean_dots" (default; measured on the H200, kda_h200.md runs 5-6: 1.52 ms at 8x4096 and 2.54 ms at
# 1x32768 vs "default" 1.89 / 3.20 and FLA 1.86 / 2.85): prep_lean._kda_fwd_prep_lean_kernel (factored
# launch with the strong-decay code compiled out plus an exact launch for flagged chunks, q/k/g in K
# slices of lean_ks, no T stored, Aqk in the working dtype), the UT matrix inverted with dots in
# lean_inv_prec (None: tf32 for bf16, ieee otherwise). "lean": the same with forward substitution.
# "default": chunk._kda_fwd_prep_kernel (the training prep).
# lean_chunk (env DELTA_ATTN_KDA_LEAN_CHUNK): 16, 32 or 0 = by shape (_lean_chunk): at 32 the
# sequential scan walks half as many chunks (measured faster for one long sequence, slower at 8x4096).
FWD_VARIANTS = ("default", "lean", "lean_dots")


def _fwd_chunk(key: str = "fwd_chunk") -> int:
    """A chunk length from CONFIG (16 or 64): "fwd_chunk" for forwards without gradient, "train_chunk"
    for the forward that keeps the backward's intermediates and that backward."""
    c = int(CONFIG[key])
    if c not in FWD_CHUNKS:
        env = "DELTA_ATTN_KDA_" + key.upper()
        raise ValueError(f"CONFIG['{key}'] / {env} must be one of {FWD_CHUNKS}, got {c}")
    return c


def _blocks(K: int, V: int, programs_per_vblock: int, key: str = "min_programs"):
    """State block K x BV (fp32 in registers): the widest BV <= 64 (and K*BV <= 8192) that still gives
    ``min_programs`` programs over sequences x heads x V blocks."""
    KP = _pow2(K)
    BV = min(_pow2(V), 64, max(16, 8192 // KP))
    while BV > 16 and programs_per_vblock * triton.cdiv(V, BV) < CONFIG[key]:
        BV //= 2
    return KP, BV


def _chunk_operands(q, v, chunk_t, bt: int, aqk_dtype):
    """The per-token / per-chunk intermediates both prep kernels write: W, qg, kd (R, HV, K), U (R, HV, V),
    Aqk (R, HV, bt) and the chunk-end decays GC (NC, HV, K)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    R, NC = B * T, chunk_t.shape[0]
    dev, dt = q.device, _work_dtype(q.dtype)
    W = torch.empty(R, HV, K, dtype=dt, device=dev)
    QG, KD = torch.empty_like(W), torch.empty_like(W)
    U = torch.empty(R, HV, V, dtype=dt, device=dev)
    AQK = torch.empty(R, HV, bt, dtype=aqk_dtype, device=dev)
    GC = torch.empty(NC, HV, K, dtype=torch.float32, device=dev)
    return W, QG, KD, U, AQK, GC


def _prep(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_qk_l2norm, chunk_t):
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    NC = chunk_t.shape[0]
    W, QG, KD, U, AQK, GC = _chunk_operands(q, v, chunk_t, BT, torch.float32)
    TM = torch.empty_like(AQK)
    if NC > 0:
        dummy = q
        _kda_fwd_prep_kernel[(NC, HV)](
            q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
            chunk_t, W, U, QG, KD, AQK, TM, GC,
            float(scale), float(lower_bound or 0.0), H, HV,
            K=K, V=V, BT=BT, BK=min(CONFIG["prep_bk"], _pow2(K)), BV=min(64, _pow2(V)), KP=_pow2(K),
            L2NORM=use_qk_l2norm, GATE=_gate_mode(A_log, lower_bound), HAS_DT_BIAS=dt_bias is not None,
            FLOOR=DECAY_FLOOR, FACTOR_MAX=CONFIG["factor_max"], DOT_PREC=_dot_prec(q.dtype),
            num_warps=CONFIG["prep_warps"])
    return W, U, QG, KD, AQK, TM, GC


def _fwd_variant() -> str:
    var = str(CONFIG["fwd_variant"])
    if var not in FWD_VARIANTS:
        raise ValueError(f"CONFIG['fwd_variant'] / DELTA_ATTN_KDA_FWD_VARIANT must be one of {FWD_VARIANTS}, got {var!r}")
    return var


def _lean_chunk(n_chains: int, K: int, V: int, device) -> int:
    """Chunk length of the lean forward: CONFIG["lean_chunk"] 16 or 32, or 0 = by shape: 32 (half the
    scan's sequential steps) when the scan over ``n_chains`` (sequence, value head) pairs has fewer
    programs than the GPU has SMs (few long sequences), else 16."""
    c = int(CONFIG["lean_chunk"])
    if c == 0:
        _, bv = _blocks(K, V, n_chains)
        return 32 if n_chains * triton.cdiv(V, bv) < sm_count(device) else 16
    if c not in (16, 32):
        raise ValueError(f"CONFIG['lean_chunk'] / DELTA_ATTN_KDA_LEAN_CHUNK must be 0, 16 or 32, got {c}")
    return c


def _prep_lean(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_qk_l2norm, chunk_t, inv: int = 0,
               bt: int = BT):
    """Forward-only 16-token prep (prep_lean.py): W, U, qg, kd, Aqk (working dtype), exp(G_last); no T."""
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    NC = chunk_t.shape[0]
    W, QG, KD, U, AQK, GC = _chunk_operands(q, v, chunk_t, bt, _work_dtype(q.dtype))
    if NC > 0:
        flags = torch.empty(NC, HV, dtype=torch.int32, device=q.device)   # every entry written by launch 1
        KP = _pow2(K)
        prec = CONFIG["lean_inv_prec"] or ("tf32" if q.dtype == torch.bfloat16 else "ieee")
        for exact in (False, True):     # factored everywhere, then the flagged chunks redone exactly
            _kda_fwd_prep_lean_kernel[(NC, HV)](
                q, k, v, g, beta, A_log if A_log is not None else q, dt_bias if dt_bias is not None else q,
                chunk_t, W, U, QG, KD, AQK, GC, flags,
                float(scale), float(lower_bound or 0.0), H, HV,
                K=K, V=V, BT=bt, BK=min(CONFIG["prep_bk"] * 16 * 16 // (bt * bt), KP), BV=min(64, _pow2(V)),
                KS=max(16, min(CONFIG["lean_ks"], KP)), L2NORM=use_qk_l2norm, GATE=_gate_mode(A_log, lower_bound),
                HAS_DT_BIAS=dt_bias is not None, FLOOR=DECAY_FLOOR, FACTOR_MAX=CONFIG["factor_max"],
                DOT_PREC=_dot_prec(q.dtype), EXACT=exact, INV=inv, INV_PREC=prec,
                num_warps=CONFIG["lean_warps"], num_stages=CONFIG["lean_stages"])
    return W, U, QG, KD, AQK, None, GC


def _prep64(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_qk_l2norm, chunk_t, store_t: bool = False):
    """Per 64-token chunk operands (chunk64.py): W, U, qg, kd, Aqk, exp(G_last), and with ``store_t`` the
    UT-transform matrices T (fp32, for the backward; else None)."""
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    NC = chunk_t.shape[0]
    # Aqk in the working dtype: the scan casts it to that anyway, half the bytes
    W, QG, KD, U, AQK, GC = _chunk_operands(q, v, chunk_t, BT64, _work_dtype(q.dtype))
    TM = torch.empty(AQK.shape, dtype=torch.float32, device=q.device) if store_t else None
    if NC > 0:
        BK = max(16, min(CONFIG["prep64_bk"], _pow2(K)))
        _kda_fwd_prep64_kernel[(NC, HV)](
            q, k, v, g, beta, A_log if A_log is not None else q, dt_bias if dt_bias is not None else q,
            chunk_t, W, U, QG, KD, AQK, GC, TM if store_t else q,
            float(scale), float(lower_bound or 0.0), H, HV,
            K=K, V=V, BT=BT64, BC=16, BK=BK, BKD=min(CONFIG["prep64_bkd"], BK), BV=min(64, _pow2(V)),
            L2NORM=use_qk_l2norm, GATE=_gate_mode(A_log, lower_bound), HAS_DT_BIAS=dt_bias is not None,
            FLOOR=DECAY_FLOOR, FACTOR_MAX=CONFIG["factor_max"], DOT_PREC=_dot_prec(q.dtype),
            STORE_T=store_t, num_warps=CONFIG["prep64_warps"])
    return W, U, QG, KD, AQK, GC, TM


def _work_dtype(dtype):
    """Storage / tensor-core dtype of the chunk intermediates (W, U, qg, kd, states for the backward):
    bf16 for bf16 inputs (bandwidth), fp32 otherwise (fp16's range and precision are too narrow for
    the UT-transform products)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _dot_prec(dtype) -> str:
    """fp32 small dots of the per-chunk kernels: tf32 tensor cores for bf16 inputs, exact FMA otherwise."""
    return "tf32" if dtype == torch.bfloat16 else "ieee"


def _contig(*ts):
    return [None if t is None else t.contiguous() for t in ts]


def kda_fwd(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale: float,
            lower_bound: Optional[float], use_qk_l2norm: bool, output_final_state: bool, store_states: bool = False,
            chunk: Optional[int] = None):
    """Chunked forward. Returns (o, final_state or None, saved) where ``saved`` holds the
    intermediates the backward needs when ``store_states``. ``chunk`` picks 16- or 64-token chunks
    (default ``CONFIG["train_chunk"]`` with ``store_states``, else ``CONFIG["fwd_chunk"]``)."""
    q, k, v, g, beta, initial_state = _contig(q, k, v, g, beta, initial_state)
    chunk = chunk or _fwd_chunk("train_chunk" if store_states else "fwd_chunk")
    if chunk == BT64:
        return _kda_fwd64(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound,
                          use_qk_l2norm, output_final_state, store_states)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    var = "default" if store_states else _fwd_variant()
    n_seq = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    bt = BT if var == "default" else _lean_chunk(n_seq * HV, K, V, q.device)
    seq_t, chunk_t, ncmax = _index_tables(B, T, cu_seqlens, q.device, bt)
    prep = _prep if var == "default" else functools.partial(_prep_lean, inv=int(var == "lean_dots"), bt=bt)
    ops = prep(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_qk_l2norm, chunk_t)
    return _scan_forward(q, v, ops, initial_state, seq_t, chunk_t, ncmax, bt, output_final_state, store_states,
                         "min_programs", "scan_warps", "scan_stages")


def _scan_forward(q, v, ops, initial_state, seq_t, chunk_t, ncmax, bt: int, output_final_state: bool,
                  store_states: bool, min_key: str, warps_key: str, stages_key: str):
    """The sequential chunk scan over the prep's operands ``ops`` = (W, U, QG, KD, AQK, TM, GC):
    returns (o, final_state or None, saved); ``saved`` keeps what the backward needs when
    ``store_states`` (chunk-start states HS and the corrected values VNEW). The launch settings come
    from CONFIG[min_key / warps_key / stages_key]."""
    W, U, QG, KD, AQK, TM, GC = ops
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N, NC = seq_t.shape[0], chunk_t.shape[0]
    o = empty((B, T, HV, V), v.dtype, q.device)
    final = empty((N, HV, K, V), torch.float32, q.device) if output_final_state else None
    HS = torch.empty(NC, HV, K, V, dtype=W.dtype, device=q.device) if store_states else None
    VNEW = torch.empty(B * T, HV, V, dtype=W.dtype, device=q.device) if store_states else None
    KP, BV = _blocks(K, V, N * HV, min_key)
    if N > 0:
        _kda_fwd_scan_kernel[(triton.cdiv(V, BV), N, HV)](
            W, U, QG, KD, AQK, GC, initial_state if initial_state is not None else q, seq_t, o,
            VNEW if store_states else q, HS if store_states else q, final if final is not None else q, HV, ncmax,
            K=K, V=V, BT=bt, KP=KP, BV=BV, USE_H0=initial_state is not None,
            STORE_FINAL=final is not None, STORE_H=store_states,
            num_warps=CONFIG[warps_key], num_stages=CONFIG[stages_key])
    saved = (W, QG, KD, AQK, TM, GC, HS, VNEW, seq_t, chunk_t, ncmax, bt) if store_states else None
    return o, final, saved


def _kda_fwd64(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
               output_final_state, store_states=False):
    """64-token path: prep64 then the same sequential scan at BT = 64; with ``store_states`` it keeps
    the backward's intermediates (T, chunk-start states, u) as the 16-token path does."""
    B, T = q.shape[:2]
    seq_t, chunk_t, ncmax = _index_tables(B, T, cu_seqlens, q.device, BT64)
    W, U, QG, KD, AQK, GC, TM = _prep64(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
                                        chunk_t, store_states)
    return _scan_forward(q, v, (W, U, QG, KD, AQK, TM, GC), initial_state, seq_t, chunk_t, ncmax, BT64,
                         output_final_state, store_states, "scan64_min_programs", "scan64_warps", "scan64_stages")


def kda_bwd(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale: float,
            lower_bound: Optional[float], use_qk_l2norm: bool, do, dht, saved=None):
    """Gradients (dq, dk, dv, dg, dbeta, dh0 or None, dA_log or None, ddt_bias or None).
    Uses the forward's intermediates ``saved`` (kda_fwd(store_states=True)) or recomputes them."""
    q, k, v, g, beta, do, dht = _contig(q, k, v, g, beta, do, dht)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    R = B * T
    if saved is None:
        saved = kda_fwd(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound,
                        use_qk_l2norm, False, store_states=True)[2]
    W, QG, KD, AQK, TM, GC, HS, VNEW, seq_t, chunk_t, ncmax, bt = saved
    N, NC = seq_t.shape[0], chunk_t.shape[0]
    KP, BV = _blocks(K, V, N * HV, "bwd_min_programs" if bt == BT else "bwd64_min_programs")
    split = bt == BT64 and CONFIG["bwd64_split"]
    NV = 1 if split else triton.cdiv(V, BV)       # slices of the partial gradients
    dev = q.device
    f32 = torch.float32
    DU = torch.empty(R, HV, V, dtype=f32, device=dev)
    DH = torch.empty(NC, HV, K, V, dtype=W.dtype, device=dev) if split else None
    DQG = torch.empty(NV, R, HV, K, dtype=f32, device=dev)
    DKD, DW = torch.empty_like(DQG), torch.empty_like(DQG)
    DAQK = torch.empty(NV, R, HV, bt, dtype=f32, device=dev)
    DGC = torch.empty(NV, NC, HV, K, dtype=f32, device=dev)
    dh0 = empty((N, HV, K, V), f32, dev) if initial_state is not None else None
    if N > 0:
        _kda_bwd_scan_kernel[(triton.cdiv(V, BV), N, HV)](
            W, QG, KD, AQK, GC, HS, VNEW, do, dht if dht is not None else q, seq_t,
            DU, DQG, DKD, DW, DAQK, DGC, dh0 if dh0 is not None else q, DH if split else q, R, NC, HV, ncmax,
            K=K, V=V, BT=bt, KP=KP, BV=BV, USE_DHT=dht is not None, STORE_DH0=dh0 is not None,
            PARTIALS=not split,
            num_warps=CONFIG["bwd_scan_warps" if bt == BT else "bwd_scan64_warps"],
            num_stages=CONFIG["scan_stages" if bt == BT else "scan64_stages"])
    if split and NC > 0:
        BKB = min(CONFIG["grads64_bk"], _pow2(K))
        _kda_bwd_chunk_grads_kernel[(NC, HV, triton.cdiv(K, BKB))](
            HS, DH, VNEW, do, DU, chunk_t, DQG, DKD, DW, DAQK, DGC, HV,
            K=K, V=V, BT=bt, BKB=BKB, BV=min(CONFIG["grads64_bv"], _pow2(V)), num_warps=CONFIG["grads64_warps"])
    dq_h = empty((B, T, HV, K), f32, dev)
    dk_h = empty((B, T, HV, K), f32, dev)
    dv = empty((B, T, HV, V), v.dtype, dev)
    db = empty((B, T, HV), f32, dev)
    dg = empty((B, T, HV, K), f32, dev)
    dal = torch.zeros(NC, HV, dtype=f32, device=dev)
    if NC > 0 and bt == BT64:
        BK = max(16, min(CONFIG["intra64_bk"], _pow2(K)))
        flags = torch.zeros(NC, HV, dtype=torch.int32, device=dev)
        for exact in (False, True):     # factored everywhere, then the flagged chunks redone exactly
            _kda_bwd_intra64_kernel[(NC, HV)](
                q, k, v, g, beta, A_log if A_log is not None else q, dt_bias if dt_bias is not None else q,
                chunk_t, TM, DU, DQG, DKD, DW, DAQK, DGC, dq_h, dk_h, dv, db, dg, dal, flags,
                float(scale), float(lower_bound or 0.0), R, NC, H, HV, NV,
                K=K, V=V, BT=BT64, BC=16, BK=BK, BV=min(64, _pow2(V)),
                L2NORM=use_qk_l2norm, GATE=_gate_mode(A_log, lower_bound), HAS_DT_BIAS=dt_bias is not None,
                FLOOR=DECAY_FLOOR, FACTOR_MAX=CONFIG["factor_max"], DOT_PREC=_dot_prec(q.dtype),
                ROUND_TF32=_dot_prec(q.dtype) == "tf32" or CONFIG["intra64_round_tf32"], EXACT=exact,
                num_warps=CONFIG["intra64_warps"])
    elif NC > 0:
        _kda_bwd_intra_kernel[(NC, HV)](
            q, k, v, g, beta, A_log if A_log is not None else q, dt_bias if dt_bias is not None else q,
            chunk_t, TM, GC, DU, DQG, DKD, DW, DAQK, DGC, dq_h, dk_h, dv, db, dg, dal,
            float(scale), float(lower_bound or 0.0), R, NC, H, HV, NV,
            K=K, V=V, BT=BT, BK=min(CONFIG["intra_bk"], _pow2(K)), BV=min(64, _pow2(V)), KP=_pow2(K),
            L2NORM=use_qk_l2norm, GATE=_gate_mode(A_log, lower_bound), HAS_DT_BIAS=dt_bias is not None,
            FLOOR=DECAY_FLOOR, FACTOR_MAX=CONFIG["factor_max"], DOT_PREC=_dot_prec(q.dtype),
            num_warps=CONFIG["intra_warps"])
    G = HV // H
    dq = (dq_h.view(B, T, H, G, K).sum(3) if G > 1 else dq_h).to(q.dtype)
    dk = (dk_h.view(B, T, H, G, K).sum(3) if G > 1 else dk_h).to(k.dtype)
    dA_log = dal.sum(0) if A_log is not None else None
    ddt = dg.sum((0, 1)).reshape(-1) if dt_bias is not None else None
    return dq, dk, dv, dg.to(g.dtype), db.to(beta.dtype), dh0, dA_log, ddt


# ----------------------------------------------------------------------------------------------
# torch.library custom ops (fake implementations for torch.compile) and autograd
# ----------------------------------------------------------------------------------------------

_E = torch.empty(0)


# Under torch.compile the forward follows CONFIG["fwd_chunk"] (it cannot see whether gradients will be
# asked for); its backward recomputes the 16-token intermediates, so the gradients are those of the
# same function either way.
@torch.library.custom_op("delta_attn::kda_chunk_fwd", mutates_args=())
def _kda_chunk_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                      A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], scale: float,
                      lower_bound: Optional[float], use_qk_l2norm: bool,
                      output_final_state: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    o, final, _ = kda_fwd(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound,
                          use_qk_l2norm, output_final_state)
    return o, (final if final is not None else q.new_empty(0, dtype=torch.float32))


@_kda_chunk_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
      output_final_state):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = v.new_empty(B, T, HV, V)
    final = q.new_empty(N, HV, K, V, dtype=torch.float32) if output_final_state else q.new_empty(0, dtype=torch.float32)
    return o, final


@torch.library.custom_op("delta_attn::kda_chunk_bwd", mutates_args=())
def _kda_chunk_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                      A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], scale: float,
                      lower_bound: Optional[float], use_qk_l2norm: bool, do: torch.Tensor,
                      dht: Optional[torch.Tensor]) -> List[torch.Tensor]:
    grads = kda_bwd(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound,
                    use_qk_l2norm, do, dht)
    return [t if t is not None else q.new_empty(0, dtype=torch.float32) for t in grads]


@_kda_chunk_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm, do, dht):
    e = q.new_empty(0, dtype=torch.float32)
    # the real op returns contiguous tensors whatever the inputs' strides: so must the fake
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape),
            initial_state.new_empty(initial_state.shape, dtype=torch.float32) if initial_state is not None else e,
            A_log.new_empty(A_log.shape, dtype=torch.float32) if A_log is not None else e,
            dt_bias.new_empty(dt_bias.shape, dtype=torch.float32) if dt_bias is not None else e]


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
     output_final_state) = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    ctx.opts = (scale, lower_bound, use_qk_l2norm, output_final_state)


def _input_grads(ctx, do, dht, run_bwd):
    """The gradients of (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale,
    lower_bound, use_qk_l2norm, output_final_state) from ``run_bwd(*saved, *opts[:3], do, dht)``."""
    q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias = ctx.saved_tensors
    scale, lower_bound, use_qk_l2norm, output_final_state = ctx.opts
    if not output_final_state or dht is None or dht.numel() == 0:
        dht = None
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, db, dh0, dal, ddt = run_bwd(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias,
                                                scale, lower_bound, use_qk_l2norm, do, dht)
    dh0 = dh0.to(initial_state.dtype) if initial_state is not None else None
    dal = dal.to(A_log.dtype) if A_log is not None else None
    ddt = ddt.to(dt_bias.dtype) if dt_bias is not None else None
    return dq, dk, dv, dg, db, dh0, None, dal, ddt, None, None, None, None


def _backward(ctx, do, dht):
    return _input_grads(ctx, do, dht, _kda_chunk_bwd_op)


torch.library.register_autograd("delta_attn::kda_chunk_fwd", _backward, setup_context=_setup_context)


class KDAFunction(torch.autograd.Function):
    """Eager autograd: the forward keeps its chunk intermediates (chunk-start states in the work dtype,
    about K*V/16 elements per token and value head) when ``CONFIG["save_intermediates"]``, so the
    backward does not recompute them; otherwise the backward recomputes. Under torch.compile the
    ``delta_attn::kda_chunk_fwd`` custom op (recomputing backward) is traced instead."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound,
                use_qk_l2norm, output_final_state):
        needs_grad = any(ctx.needs_input_grad)
        keep = CONFIG["save_intermediates"] and needs_grad
        # with gradients the forward runs on the training chunk length (CONFIG["train_chunk"])
        o, final, saved = kda_fwd(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound,
                                  use_qk_l2norm, output_final_state, store_states=keep,
                                  chunk=_fwd_chunk("train_chunk") if needs_grad else None)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
        ctx.saved_chunks = saved
        ctx.opts = (scale, lower_bound, use_qk_l2norm, output_final_state)
        return o, (final if final is not None else q.new_empty(0, dtype=torch.float32))

    @staticmethod
    def backward(ctx, do, dht):
        saved, ctx.saved_chunks = ctx.saved_chunks, None
        return _input_grads(ctx, do, dht, lambda *args: kda_bwd(*args, saved))


@torch.library.custom_op("delta_attn::kda_step", mutates_args=("state",))
def _kda_step_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, state_indices: Optional[torch.Tensor], A_log: Optional[torch.Tensor],
                 dt_bias: Optional[torch.Tensor], scale: float, lower_bound: Optional[float],
                 use_qk_l2norm: bool) -> torch.Tensor:
    return kda_step_fwd(q, k, v, g, beta, state, state_indices, A_log, dt_bias, scale, lower_bound, use_qk_l2norm)


@_kda_step_op.register_fake
def _(q, k, v, g, beta, state, state_indices, A_log, dt_bias, scale, lower_bound, use_qk_l2norm):
    return v.new_empty(v.shape)


def kda_step_fwd(q, k, v, g, beta, state, state_indices, A_log, dt_bias, scale, lower_bound, use_qk_l2norm):
    """Decode launcher: updates ``state`` in place, returns o (B, T, HV, V)."""
    q, k, v, g, beta = _contig(q, k, v, g, beta)
    if not state.is_contiguous():
        raise ValueError("state must be a contiguous (P, HV, K, V) pool for backend='triton', got strides "
                         f"{tuple(state.stride())}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = empty((B, T, HV, V), v.dtype, q.device)
    KP = _pow2(K)
    BV = min(_pow2(V), CONFIG["step_bv"] if KP <= 128 else CONFIG["step_bv"] // 2)
    if B > 0:
        _kda_step_kernel[(triton.cdiv(V, BV), B, HV)](
            q, k, v, g, beta, A_log if A_log is not None else q, dt_bias if dt_bias is not None else q,
            state, state_indices if state_indices is not None else q, o,
            float(scale), float(lower_bound or 0.0), T, H, HV,
            K=K, V=V, KP=KP, BV=BV, L2NORM=use_qk_l2norm, GATE=_gate_mode(A_log, lower_bound),
            HAS_DT_BIAS=dt_bias is not None, HAS_IDX=state_indices is not None,
            num_warps=CONFIG["step_warps"])
    return o


# ----------------------------------------------------------------------------------------------
# backend entry points (receive the validated KDAArgs)
# ----------------------------------------------------------------------------------------------

def kda(a: KDAArgs):
    args = (a.q, a.k, a.v, a.g, a.beta, a.initial_state, a.cu_seqlens, a.A_log, a.dt_bias, float(a.scale),
            a.lower_bound, bool(a.use_qk_l2norm), bool(a.output_final_state))
    if torch.compiler.is_compiling():
        o, final = _kda_chunk_fwd_op(*args)            # traced: custom op with a fake implementation
    elif a.needs_grad():
        o, final = KDAFunction.apply(*args)            # eager: no dispatcher overhead, saved intermediates
    else:                                              # inference (ctx.needs_input_grad ignores no_grad)
        o, final, _ = kda_fwd(*args)
    return o, (final if a.output_final_state else None)


def kda_step(a: KDAArgs):
    args = (a.q, a.k, a.v, a.g, a.beta, a.state, a.state_indices, a.A_log, a.dt_bias, float(a.scale),
            a.lower_bound, bool(a.use_qk_l2norm))
    if torch.compiler.is_compiling():
        return _kda_step_op(*args)
    return kda_step_fwd(*args)                         # eager decode: skip the dispatcher (launch-bound)
