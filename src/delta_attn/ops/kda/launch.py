"""Host side of the Triton KDA backend: one pipeline per use, its tile configs and its precision.

* **training**: ``train_forward`` (intra-chunk stage on 64-token chunks keeping T, then the state scan
  keeping the chunk-start states and u) and ``train_backward`` (reverse scan, per-chunk operand
  gradients, intra-chunk backward);
* **inference prefill**: ``infer_forward`` (intra-chunk stage on 16- or 32-token chunks, factored launch
  plus an exact launch for strongly decaying chunks, then the state scan);
* **decode**: ``decode_step`` (token by token from a state pool, in place).
* the carry of context parallelism (rows run from state 0 with their transition, the true start folded in) is
  ``launch_carry.py``, over these pipelines.

Tiles are frozen :class:`~delta_attn.ops._launch.Tiles` chosen by shape in the ``*_tiles`` functions below,
each with its reason; every launch goes through :func:`~delta_attn.ops._launch.launch`, which falls back to
smaller tiles when the device's shared memory is too small for the tuned ones.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ... import _checks as C
from ..._outputs import empty
from ...backends import device_capability
from .._gluon import KERNELS_TRITON, available as gluon_available, version as gluon_version
from .._decay_max import read_max
from .._launch import (Tiles, cdiv, compile_device, compile_only, compiled_together, halving, in_launch_order, index,
                       launch, next_pow2, optional, param, sm_count, tiles)
from .kernels_backward import _kda_bwd_chunk_grads_kernel, _kda_bwd_intra_kernel, _kda_bwd_scan_kernel
from .kernels_backward_gluon import (BK as FUSED_BWD_BK, BV as FUSED_BWD_BV, WARPS as FUSED_BWD_WARPS,
                                     _kda_bwd_intra_fused_kernel)
from .kernels_decode import _kda_step_kernel, _kda_step_kernel_gluon, step_layout
from .kernels_scan_gluon import ROWS as FUSED_SCAN_ROWS, _kda_bwd_scan_fused_kernel, _kda_fwd_scan_fused_kernel
from .kernels_fused import (BT as FUSED_CHUNK, FACTOR_REGS as FUSED_FACTOR_REGS, WARPS as FUSED_WARPS,
                            WS_MAXNREG as FUSED_WS_MAXNREG, _kda_fused_fwd_kernel, _kda_fused_ws_kernel)
from .kernels_gate import DECAY_FLOOR
from .kernels_intra import _kda_infer_intra_kernel, _kda_train_intra_kernel
from .kernels_intra_gluon import (BC as FUSED_INTRA_BC, BK as FUSED_INTRA_BK, WARPS as FUSED_INTRA_WARPS,
                                  _kda_train_intra_fused_kernel)
from .kernels_scan import _kda_fwd_scan_kernel

TRAIN_CHUNK = 64      # tokens per chunk of the training pipeline (4 sub-chunks of 16, tensor-core sized)
CHUNK_LENGTHS = (16, 32, TRAIN_CHUNK)   # every chunk length a pipeline runs (inference: infer_chunk's 16 or 32)
FACTOR_MAX = 60.0     # |cumulative log decay| up to which exp(G_i - G_j) is formed as a product of two factors
FUSED_MIN_PROGRAMS = 64   # (sequence, value head) pairs from which the fused inference forward runs
INTRA_FUSED_TILES = tiles("one warpgroup per (chunk, value head); K slices of 32", num_warps=FUSED_INTRA_WARPS)
BWD_INTRA_FUSED_TILES = tiles("one warpgroup per (chunk, head); K slices of 16, V of 64", num_warps=FUSED_BWD_WARPS)
TANGENT_MAX = 16.0    # fp32 backward with a gate: |cumulative gate tangent| from the chunk's middle row up to which
                      # the gate parameters' gradients are formed from the factored products, whose rounding it
                      # weights (CPU fuzz, K 16, V 48, gate input + 1: dA_log at 0.91 of the rule without this
                      # limit, 0.04 with it); beyond, the exact products (kernels_backward.py)


# ---- precision -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Precision:
    """Input precision of the kernels' dots and the storage dtype of the intermediates."""
    work: torch.dtype      # intermediates (W, U, qg, kd, Aqk, states): bf16 for bf16, else fp32
    dot: str               # per-chunk dots (intra-chunk products, U / W, backward intra)
    scan: str              # dots of the backward state scan and of the per-chunk operand gradients
    fwd_scan: str          # dots of the forward state scan (they make the output)
    two_float: bool        # cumulative log decays in two floats (fp32 with exact dots: kernels_gate._kda_cumsum)
    intra_op: tl.dtype     # operand dtype of the forward intra-chunk products


def precision(dtype: torch.dtype, allow_tf32: bool, K: int, train: bool = False) -> Precision:
    """bf16: the scans' dots take the bf16-stored intermediates as they are (bf16 tensor-core products; the training
    backward's du is one of them; the Triton reverse scan's kd dS as two of them, ``kd_dtype``); the forward
    intra-chunk products (inference and training) on bf16 operands (bf16 tensor-core rate; their results are stored
    in bf16); the UT transform's U and W on fp32 operands in tf32, every K
    (with T as a bf16 register operand both came out wrong on the GPU: kernels_intra._kda_apply_ut); tf32 for the fp32
    tiles of the triangular inverse and of the backward's per-chunk products. fp16: exact per-chunk dots (fp16's range
    is too narrow for the UT products). tf32 keeps only fp16's 10-bit mantissa, which doubles fp16's rounding (H200
    property seeds: output 8 % over the rule with a tf32 forward scan, dbeta 60 % over with tf32 backward scans), so
    fp16 scans run 3xTF32 or IEEE: the inference forward scan in 3xTF32 for K <= 128; the training forward scan in
    3xTF32 for K <= 64 and IEEE above (3xTF32 training scans with a 128-wide state tile read out of bounds on the H200);
    the backward scans in IEEE. fp32: exact (IEEE) everywhere unless ``allow_tf32``. With exact dots (fp32) the
    cumulative log decays are kept in two floats (``kernels_gate._kda_cumsum``: one fp32 loses too much of an exponent
    G_i - G_j formed near the end of a strongly decaying 64-token chunk).

    fp16 and fp32 inputs take tf32 dots on fp32 tiles only for K <= 128: with K > 128 (a 256-wide padded state
    tile) Triton 3.6's tf32 kernels read out of bounds on the H200 (illegal address in the fp16 training backward,
    measured at K = 144 and 192) and lost accuracy where they ran; IEEE dots are exact there. bf16's tf32 dots on
    fp32 tiles above K 128 (the UT transform, the backward's per-chunk products) pass test_kda_gpu's draws
    (docs/PERFORMANCE.md)."""
    tf32_ok = K <= 128
    if dtype == torch.bfloat16:
        return Precision(torch.bfloat16, "tf32", "tf32", "tf32", False, tl.bfloat16)
    if dtype == torch.float16:
        x3_ok = K <= (64 if train else 128)
        return Precision(torch.float32, "ieee", "ieee", "tf32x3" if x3_ok else "ieee", False, tl.float32)
    p = "tf32" if allow_tf32 and tf32_ok else "ieee"
    return Precision(torch.float32, p, p, p, p == "ieee", tl.float32)


# ---- index tables and tiles ----------------------------------------------------------------------------------------

class Chunks(NamedTuple):
    seq_t: torch.Tensor      # (N, 3) int32: first row, length, first chunk
    chunk_t: torch.Tensor    # (NC, 3) int32: sequence, first row, length
    ncmax: int               # the longest sequence's chunk count
    bt: int                  # chunk length


def chunk_tables(B: int, T: int, cu_seqlens, device, bt: int,
                 upload: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Chunks:
    """The chunk tables of a call: built once per shape for a dense batch (no host work after the first call);
    from the offsets read on the host for a packed one (``cu_seqlens``: a tensor, or host ints). ``upload`` takes
    each host int32 table to ``device`` (default: a blocking copy); the distributed plan passes its pinned,
    non-blocking one and keeps the tables itself (a dense batch's built here from ints, reading no tensor)."""
    if cu_seqlens is None:
        if upload is None:
            return _dense_chunk_tables(B, T, torch.device(device), bt)
        return _dense_tables(B, T, device, bt, upload)
    cu = (cu_seqlens.to("cpu", torch.int64) if isinstance(cu_seqlens, torch.Tensor)
          else torch.tensor(cu_seqlens, dtype=torch.int64))
    return _tables(cu[:-1], cu[1:] - cu[:-1], device, bt, upload)


@functools.lru_cache(maxsize=64)
def _dense_chunk_tables(B: int, T: int, device: torch.device, bt: int) -> Chunks:
    return _dense_tables(B, T, device, bt)


def _dense_tables(B: int, T: int, device, bt: int, upload=None) -> Chunks:
    nc = cdiv(T, bt)
    return _tables(torch.arange(B, dtype=torch.int64) * T, torch.full((B,), T, dtype=torch.int64), device, bt,
                   upload, counts=(B * nc, nc if B else 0))


def _tables(starts: torch.Tensor, lens: torch.Tensor, device, bt: int, upload=None, counts=None) -> Chunks:
    """``counts``: (chunks, the longest sequence's chunk count) when the caller knows them (no read of a table)."""
    nch = (lens + bt - 1) // bt
    total, ncmax = counts if counts is not None else (int(nch.sum()), int(nch.max()) if len(nch) else 0)
    first = torch.cumsum(nch, 0) - nch
    seq_t = torch.stack([starts, lens, first], 1)
    seq_id = torch.repeat_interleave(torch.arange(len(lens)), nch, output_size=total)
    local = torch.arange(total) - first[seq_id]
    t0 = starts[seq_id] + local * bt
    chunk_t = torch.stack([seq_id, t0, torch.clamp(lens[seq_id] - local * bt, max=bt)], 1)
    put = upload or (lambda t: t.to(device))
    return Chunks(put(seq_t.to(torch.int32)), put(chunk_t.to(torch.int32)), ncmax, bt)


def max_chunks(B: int, T: int, n_seq: int, varlen: bool, bt: int = TRAIN_CHUNK) -> int:
    """An upper bound of the chunk count that depends on shapes only (the saved per-chunk tensors are
    allocated with it, so their shapes are known to torch.compile): sum_i ceil(len_i / bt) <= T // bt + N."""
    return T // bt + n_seq if varlen else B * triton.cdiv(T, bt)


def _state_block(K: int, V: int, chains: int, min_programs: int) -> int:
    """BV of the K x BV fp32 state block a scan program holds: the widest <= 64 (K * BV <= 8192 registers'
    worth) that still gives ``min_programs`` programs over (sequence, value head) chains x V blocks."""
    bv = min(next_pow2(V), 64, max(16, 8192 // next_pow2(K)))
    while bv > 16 and chains * triton.cdiv(V, bv) < min_programs:
        bv //= 2
    return bv


def infer_chunk(chains: int, K: int, V: int, device) -> int:
    """Inference chunk length: 32 when the scan has fewer programs than the GPU has SMs (few long sequences:
    half the sequential steps), else 16 (measured faster at 8 x 4096 on an H200, docs/PERFORMANCE.md)."""
    bv = _state_block(K, V, chains, 256)
    return 32 if chains * triton.cdiv(V, bv) < sm_count(device) else 16


@functools.lru_cache(maxsize=None)
def infer_intra_tiles(K: int, V: int, bt: int):
    KP = next_pow2(K)
    first = tiles("K slices of 32 for the factored dots; exact pairwise tiles of bt x bt x BK", num_warps=4,
                  KS=max(16, min(32, KP)), BK=min(16 * 256 // (bt * bt), KP), BV=min(64, next_pow2(V)))
    return halving(first, ("KS", "BV"))


@functools.lru_cache(maxsize=None)
def scan_tiles(K: int, V: int, chains: int, bt: int, min_programs: int, warps: int, stages: int):
    """The state block K x BV in registers, BV narrowed until the grid has enough programs; when the chunk's
    K-wide tiles do not fit the shared memory (fp32 work dtype, K > 128, 64-token chunks), each chunk is walked
    as two row halves (SPLIT 2) before BV is narrowed."""
    first = tiles("state block K x BV in registers; BV narrowed until the grid has enough programs",
                  num_warps=warps, num_stages=stages, KP=next_pow2(K), BV=_state_block(K, V, chains, min_programs),
                  SPLIT=1)
    out = []
    for t in halving(first, ("BV",)):
        out.append(t)
        if bt >= 32:
            out.append(t.with_(reason="fits shared memory: the chunk as two row halves", SPLIT=2))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def train_intra_tiles(K: int, V: int):
    BK = max(16, min(32, next_pow2(K)))
    first = tiles("64-token chunk in K slices of 32; exact diagonal blocks 4 channels at a time", num_warps=4,
                  BK=BK, BKD=min(4, BK), BV=min(64, next_pow2(V)))
    return halving(first, ("BK", "BV"))


@functools.lru_cache(maxsize=None)
def chunk_grads_tiles(K: int, V: int):
    first = tiles("full K block per program (one pass over V)", num_warps=8, BKB=min(128, next_pow2(K)),
                  BV=min(32, next_pow2(V)))
    return halving(first, ("BKB", "BV"))


@functools.lru_cache(maxsize=None)
def bwd_intra_tiles(K: int, V: int):
    first = tiles("K slices of 16 (the exact path's 16x16xBK tiles)", num_warps=4, BK=16, BV=min(64, next_pow2(V)))
    return halving(first, ("BV",))


@functools.lru_cache(maxsize=None)
def step_tiles(K: int, V: int) -> Tiles:
    """The decode step's launch config: BV (value columns per program, so V / BV x B x HV programs) and warps.
    ``KP`` (K to a power of two) is fixed by the shape."""
    return tiles("measured fastest of BV {16..64} x warps {1..8} for 64 sequences (H200)", num_warps=4,
                 BV=min(next_pow2(V), 64 if next_pow2(K) <= 128 else 32))


def _gate_args(A_log, dt_bias, lower_bound, like):
    mode = 0 if A_log is None else (1 if lower_bound is None else 2)
    return (optional(A_log, like), optional(dt_bias, like)), dict(GATE=mode, HAS_DT_BIAS=dt_bias is not None)


# ---- forward: intra-chunk stage + state scan -----------------------------------------------------------------------

class Saved(NamedTuple):
    """What the training forward keeps for the backward (per-chunk tensors have ``max_chunks`` rows)."""
    W: torch.Tensor
    QG: torch.Tensor
    KD: torch.Tensor
    AQK: torch.Tensor
    TM: torch.Tensor
    GC: torch.Tensor
    HS: torch.Tensor
    VNEW: torch.Tensor


def kd_dtype(q, v, work: torch.dtype, train: bool) -> torch.dtype:
    """KD = k e^(G_last - G)'s storage: float32 for a training call whose scans are the Triton ones, whose reverse
    scan takes kd dS as two products on kd's bf16 rounding and its remainder (``kernels_backward._kd_dot``; with KD
    rounded to bf16, GPU fuzz seed 997's dbeta was 1.09x over the error rule); else the work dtype (the Gluon scans
    read a bf16 KD; inference outputs pass with it)."""
    if train and _scan_fused_unsupported(q, v, compile_device(q.device)) is not None:
        return torch.float32
    return work


def _operands(q, v, nc_alloc: int, bt: int, work: torch.dtype, train: bool):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    R, dev = B * T, q.device
    W = torch.empty(R, HV, K, dtype=work, device=dev)
    QG = torch.empty_like(W)
    KD = torch.empty(R, HV, K, dtype=kd_dtype(q, v, work, train), device=dev)
    U = torch.empty(R, HV, V, dtype=work, device=dev)
    AQK = torch.empty(R, HV, bt, dtype=work, device=dev)
    GC = torch.empty(nc_alloc, HV, K, dtype=torch.float32, device=dev)
    TM = torch.empty(R, HV, bt, dtype=torch.float32, device=dev) if train else None
    return W, QG, KD, U, AQK, GC, TM


def _forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
             output_final_state, allow_tf32, train: bool, chunks: Optional[Callable[[int], Chunks]] = None,
             keep_operands: bool = False):
    """(o, final or None, Saved: training, or with ``keep_operands`` the intra-chunk operands alone); ``chunks``: the
    chunk tables of a chunk length (default: built here from ``cu_seqlens``)."""
    q, k, v, g, beta, initial_state, A_log, dt_bias = map(param, (q, k, v, g, beta, initial_state, A_log, dt_bias))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    prec = precision(q.dtype, allow_tf32, q.shape[-1], train)
    bt = TRAIN_CHUNK if train else infer_chunk(N * HV, K, V, q.device)
    ch = chunks(bt) if chunks is not None else chunk_tables(B, T, cu_seqlens, q.device, bt)
    NC = ch.chunk_t.shape[0]
    nc_alloc = max_chunks(B, T, N, cu_seqlens is not None) if train else NC
    W, QG, KD, U, AQK, GC, TM = _operands(q, v, nc_alloc, bt, prec.work, train)
    gluon_first = NC > 0 and train and _train_intra_fused_unsupported(q, v, A_log, dt_bias, lower_bound, prec,
                                                                      compile_device(q.device)) is None
    # the g check's reduction by the Gluon kernel, where the call expects it (kda's api: train_reports_decay)
    report = C.decay_report_sink(g) if gluon_first else None
    if gluon_first:
        g, beta = _gluon_float(g), _gluon_float(beta)
    gate_ptrs, gate_kw = _gate_args(A_log, dt_bias, lower_bound, q)
    common = (q, k, v, g, beta) + gate_ptrs + (ch.chunk_t,)
    fixed = dict(K=K, V=V, BT=bt, L2NORM=use_qk_l2norm, FLOOR=DECAY_FLOOR, FACTOR_MAX=FACTOR_MAX,
                 DOT_PREC=prec.dot, TWO_FLOAT=prec.two_float, **gate_kw)
    with compiled_together():        # the stages' kernels compile concurrently on first use
        # 1. intra-chunk stage (training: the Gluon kernel's factored products where it runs, then the Triton
        #    kernel on the pairs it flagged; else the Triton kernel on every pair)
        if NC > 0 and train:
            out = (W, U, QG, KD, AQK, GC, TM)
            flags = torch.empty(NC, HV, dtype=torch.int32, device=q.device) if gluon_first else None  # all written
            if gluon_first:
                gmax = torch.empty(NC, HV, dtype=torch.float32, device=q.device) if report else None
                launch(_kda_train_intra_fused_kernel, lambda t: (NC, HV),
                       (q, k, v, g, beta, ch.chunk_t) + out + (flags, optional(gmax, g), float(scale), H, HV),
                       dict(K=K, V=V, BT=bt, BK=FUSED_INTRA_BK, BC=FUSED_INTRA_BC, L2NORM=bool(use_qk_l2norm),
                            FLOOR=DECAY_FLOOR, FACTOR_MAX=FACTOR_MAX, NW=FUSED_INTRA_WARPS,
                            GBITS=8 * g.element_size(), GTOP=report is not None),
                       (INTRA_FUSED_TILES,))
                if report is not None:      # its copy to the host, enqueued before the later kernels
                    in_launch_order(lambda: report(read_max(gmax)))
            launch(_kda_train_intra_kernel, lambda t: (NC, HV),
                   common + out + (optional(flags, q), float(scale), float(lower_bound or 0.0), H, HV),
                   dict(fixed, BC=16, INV_PREC=prec.dot, OP=prec.intra_op, ONLY_FLAGGED=gluon_first),
                   train_intra_tiles(K, V))
        elif NC > 0:
            flags = torch.empty(NC, HV, dtype=torch.int32, device=q.device)    # every entry written by launch 1
            for exact in (False, True):      # factored everywhere, then the flagged chunks redone exactly
                launch(_kda_infer_intra_kernel, lambda t: (NC, HV),
                       common + (W, U, QG, KD, AQK, GC, flags, float(scale), float(lower_bound or 0.0), H, HV),
                       dict(fixed, EXACT=exact, INV_PREC=prec.dot, OP=prec.intra_op), infer_intra_tiles(K, V, bt))
        # 2. state scan and output
        o = empty((B, T, HV, V), v.dtype, q.device)
        final = empty((N, HV, K, V), torch.float32, q.device) if output_final_state else None
        HS = torch.empty(nc_alloc, HV, K, V, dtype=prec.work, device=q.device) if train else None
        VNEW = torch.empty(B * T, HV, V, dtype=prec.work, device=q.device) if train else None
        if N > 0 and train and _scan_fused_unsupported(q, v, compile_device(q.device)) is None:
            launch(_kda_fwd_scan_fused_kernel, lambda t: (V // t.get("BV"), N, HV),
                   (W, U, QG, KD, AQK, GC, optional(initial_state, q), ch.seq_t, o, VNEW, HS, optional(final, q), HV),
                   dict(K=K, V=V, BT=bt, USE_H0=initial_state is not None, STORE_FINAL=final is not None,
                        STORE_H=True),
                   scan_fused_tiles(N * HV, compile_device(q.device)))
        elif N > 0:
            cand = scan_tiles(K, V, N * HV, bt, 256, 4, 2 if train else 3)
            launch(_kda_fwd_scan_kernel, lambda t: (triton.cdiv(V, t.get("BV")), N, HV),
                   (W, U, QG, KD, AQK, GC, optional(initial_state, q), ch.seq_t, o, optional(VNEW, q), optional(HS, q),
                    optional(final, q), HV, ch.ncmax),
                   dict(K=K, V=V, BT=bt, USE_H0=initial_state is not None, STORE_FINAL=final is not None,
                        STORE_H=train, PREC=prec.fwd_scan), cand)
    saved = Saved(W, QG, KD, AQK, TM, GC, HS, VNEW) if train or keep_operands else None
    return o, final, saved


def _gluon_unsupported(kernel, q, v, device: torch.device) -> Optional[str]:
    """Why a Gluon KDA kernel (``kernel``: None where Gluon is missing) does not run a call on ``device``, for the
    conditions every one of them shares: CUDA with Gluon, the Triton release of its API, sm_90, bf16, K = V = 128."""
    if not gluon_available(device) or kernel is None:
        return "not a CUDA call with Gluon available"
    if gluon_version() != KERNELS_TRITON:
        return (f"Triton {triton.__version__}: the kernel is written for the Gluon API of Triton "
                f"{'.'.join(map(str, KERNELS_TRITON))}")
    if device_capability(device) != (9, 0):
        return "not an sm_90 GPU (the kernel's wgmma is Hopper's)"
    if q.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return "q, k, v are not bfloat16"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return "K and V are not both 128"
    return None


def _scan_fused_unsupported(q, v, device: torch.device) -> Optional[str]:
    """Why the Gluon training scans (``kernels_scan_gluon.py``) do not replace the Triton ones (None: they do); they
    read the 64-token chunks' bf16 intermediates only, whatever the gate."""
    why = _gluon_unsupported(_kda_bwd_scan_fused_kernel, q, v, device)
    return why if why is not None else _gluon_unsupported(_kda_fwd_scan_fused_kernel, q, v, device)


def scan_fused_tiles(chains: int, device) -> Tuple[Tiles, ...]:
    """The Gluon scans' launch, one warpgroup per 64 value rows (the wgmma's M). When two programs per chain are no
    more than the SMs: V blocks of 64, each program alone on its SM with a two-stage operand ring (the chain's
    latency is the step's). Else the whole V in one program per chain: two warpgroups share each chunk's operand
    tiles, read once instead of once per V block (8 warps, one program per SM; two-stage ring of 176-192 KB, one
    stage where that does not fit). Measured crossover on an H100 (132 SMs): V blocks faster at 16-64 chains, the
    whole V at 96 and more (docs/PERFORMANCE.md)."""
    def block(why: str, bv: int) -> Tiles:
        warps = 4 * bv // FUSED_SCAN_ROWS           # one warpgroup per 64 value rows; the kernels' NW
        return tiles(why, num_warps=warps, BV=bv, NW=warps, STAGES=2)

    if 2 * chains <= sm_count(device):
        return (block("V blocks of 64, one warpgroup, two-stage ring: the chains do not fill the SMs",
                      FUSED_SCAN_ROWS),)
    whole = block("whole V per program, two warpgroups; two-stage operand ring", 2 * FUSED_SCAN_ROWS)
    return whole, whole.with_("one stage where two do not fit", STAGES=1)


def fused_forward_unsupported(q, v, A_log, num_seqs: int) -> Optional[str]:
    """Why the fused Gluon forward (``kernels_fused.py``) does not run this inference call (None: it does)."""
    why = _gluon_unsupported(_kda_fused_fwd_kernel, q, v, q.device)
    if why is not None:
        return why
    if A_log is not None:
        return "a gate (A_log, dt_bias, lower_bound) is given"
    if num_seqs * v.shape[2] < FUSED_MIN_PROGRAMS:
        return (f"{num_seqs * v.shape[2]} (sequence, value head) pairs: one program each would leave the GPU idle "
                f"(fewer than {FUSED_MIN_PROGRAMS})")
    return None


def _train_gluon_unsupported(kernel, q, v, A_log, dt_bias, lower_bound, prec: Precision,
                             device: torch.device) -> Optional[str]:
    """Why a Gluon kernel of the training pipeline does not run this call: :func:`_gluon_unsupported`, then the
    training kernels' own conditions (no gate parameters, one-float decays; they read g and beta as
    :func:`_gluon_float` gives them). ``device``: the device the call runs on (or, compiled ahead on meta tensors,
    compiles for: ``_launch.compile_device``)."""
    why = _gluon_unsupported(kernel, q, v, device)
    if why is not None:
        return why
    if A_log is not None or dt_bias is not None or lower_bound is not None:
        return "a gate (A_log, dt_bias, lower_bound) is given"
    if prec.two_float:
        return "cumulative log decays in two floats (exact dots)"
    return None


# None where the Gluon factored intra-chunk backward (``kernels_backward_gluon.py``) replaces the Triton
# ``EXACT=False`` launch, and where the Gluon intra-chunk forward (``kernels_intra_gluon.py``) takes the training
# forward's intra-chunk stage (the Triton kernel then redoing only the pairs it flags); else why not
_bwd_intra_fused_unsupported = functools.partial(_train_gluon_unsupported, _kda_bwd_intra_fused_kernel)
_train_intra_fused_unsupported = functools.partial(_train_gluon_unsupported, _kda_train_intra_fused_kernel)


def train_reports_decay(q, v, g, A_log, dt_bias, lower_bound, allow_tf32: bool) -> bool:
    """Whether a training call's first kernel, the Gluon intra-chunk forward, reads the whole g as given (no cast, no
    copy: a contiguous g) and so writes the g check's maximum for it (``_forward``, ``_checks.decay_report_sink``)."""
    prec = precision(q.dtype, allow_tf32, q.shape[-1], True)
    return (q.shape[1] > 0 and _gluon_float(g) is g and g.is_contiguous()
            and _train_intra_fused_unsupported(q, v, A_log, dt_bias, lower_bound, prec, q.device) is None)


def _gluon_float(t):
    """g or beta as the Gluon training kernels read it: as given in float32, bfloat16 or float16 (they widen 16-bit
    values to float32 on chip, exactly, with no cast pass), else cast to float32."""
    return t if t.dtype in (torch.float32, torch.bfloat16, torch.float16) else t.float()


def fused_forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state):
    """The fused Gluon inference forward: (o, final_state or None); g in float32, beta in float32."""
    q, k, v, g, beta, initial_state = (param(q), param(k), param(v), param(g, torch.float32),
                                       param(beta, torch.float32), param(initial_state, torch.float32))
    B, T, H, K = q.shape
    HV = v.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = empty(v.shape, v.dtype, q.device)
    final = empty((N, HV, K, K), torch.float32, q.device) if output_final_state else None
    if N > 0:
        cu = index(cu_seqlens) if cu_seqlens is not None else None
        kernel, extra = fused_kernel(N * HV, q.device)
        kernel[(HV, N)](
            q, k, v, g, beta, o, optional(cu, q), optional(initial_state, g), optional(final, g),
            T, H, HV, HV // H, float(scale), K=K, BT=FUSED_CHUNK, W=FUSED_WARPS, FACTOR_MAX=FACTOR_MAX,
            L2NORM=bool(use_qk_l2norm), VARLEN=cu is not None, HAS_H0=initial_state is not None,
            STORE_FINAL=final is not None, TAIL=cu is not None or T % FUSED_CHUNK != 0 or T == 0,
            num_warps=FUSED_WARPS, **extra)
    return o, final


def fused_kernel(pairs: int, device: torch.device):
    """The fused forward's form for ``pairs`` (sequence, value head) programs (measured, docs/PERFORMANCE.md): the
    warp-specialised one (a second warpgroup builds the factors; one program per SM, launched at WS_MAXNREG
    registers per thread, which leaves room for the g check's small reduction beside it) where they fill no more
    than the SMs; else the one-warpgroup kernel, two of whose programs share an SM."""
    if pairs <= sm_count(device):
        return _kda_fused_ws_kernel, dict(FACTOR_REGS=FUSED_FACTOR_REGS, maxnreg=FUSED_WS_MAXNREG)
    return _kda_fused_fwd_kernel, {}


def check_fits_beside(q, v, A_log, num_seqs: int) -> bool:
    """Whether an inference call's kernels leave room on every SM for the g check's small reduction
    (``ops/_decay_max.py``): the fused forward's warp-specialised form does; its one-warpgroup form (two programs
    per SM) takes every register, and the split kernels fill the SMs, where torch's amax finishes sooner."""
    return (fused_forward_unsupported(q, v, A_log, num_seqs) is None
            and fused_kernel(num_seqs * v.shape[2], q.device)[0] is _kda_fused_ws_kernel)


def infer_forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
                  output_final_state, allow_tf32):
    """Inference prefill: (o, final_state or None), by the fused Gluon kernel where it runs
    (:func:`fused_forward_unsupported`), else by the intra-chunk stage and the state scan."""
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if fused_forward_unsupported(q, v, A_log, N) is None:
        return fused_forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, output_final_state)
    o, final, _ = _forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound,
                           use_qk_l2norm, output_final_state, allow_tf32, train=False)
    return o, final


def train_forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
                  output_final_state, allow_tf32):
    """Training forward: (o, final_state or None, Saved). The first call of a specialisation also compiles
    the backward's kernels, concurrently with its own (:func:`_compile_backward`)."""
    with compiled_together():
        o, final, saved = _forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound,
                                   use_qk_l2norm, output_final_state, allow_tf32, train=True)
        _compile_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, o, final, saved, scale,
                          lower_bound, use_qk_l2norm, allow_tf32)
    return o, final, saved


_BACKWARD_COMPILED: set = set()


def _compile_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, o, final, saved, scale,
                      lower_bound, use_qk_l2norm, allow_tf32, chunks: Optional[Callable[[int], Chunks]] = None):
    """Once per specialisation: :func:`train_backward` on meta tensors of the real dtypes and shapes under
    ``compile_only``, so its kernels compile with the forward's (a final state is taken to get a gradient);
    ``chunks`` as in :func:`train_backward`."""
    key = (q.device, q.dtype, v.dtype, g.dtype, beta.dtype, q.shape[2:], v.shape[2:], initial_state is not None,
           final is not None, cu_seqlens is not None, A_log is not None, dt_bias is not None, lower_bound is not None,
           use_qk_l2norm, allow_tf32)
    if key in _BACKWARD_COMPILED:
        return
    _BACKWARD_COMPILED.add(key)

    def meta(t):       # torch.empty, not empty_like: a meta empty_like runs torch's Python refs (imports sympy)
        return None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")

    with compile_only(q.device):
        train_backward(*map(meta, (q, k, v, g, beta, initial_state)), cu_seqlens, meta(A_log), meta(dt_bias),
                       Saved(*map(meta, saved)), meta(o), meta(final), scale, lower_bound, use_qk_l2norm, allow_tf32,
                       chunks=chunks)


# ---- backward ------------------------------------------------------------------------------------------------------

def train_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, saved: Saved, do, dht, scale,
                   lower_bound, use_qk_l2norm, allow_tf32, chunks: Optional[Callable[[int], Chunks]] = None):
    """Gradients (dq, dk, dv, dg, dbeta, dh0 or None, dA_log or None, ddt_bias or None). ``initial_state`` is read
    for its presence only (dh0); ``chunks``: the chunk tables of a chunk length (default: built here)."""
    q, k, v, g, beta, do, dht, A_log, dt_bias = map(param, (q, k, v, g, beta, do, dht, A_log, dt_bias))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    R, dev, f32 = B * T, q.device, torch.float32
    prec = precision(q.dtype, allow_tf32, q.shape[-1], train=True)
    ch = chunks(TRAIN_CHUNK) if chunks is not None else chunk_tables(B, T, cu_seqlens, dev, TRAIN_CHUNK)
    N, NC, bt = ch.seq_t.shape[0], ch.chunk_t.shape[0], TRAIN_CHUNK
    W, QG, KD, AQK, TM, GC, HS, VNEW = saved
    g_dtype, beta_dtype = g.dtype, beta.dtype
    gluon_first = NC > 0 and _bwd_intra_fused_unsupported(q, v, A_log, dt_bias, lower_bound, prec,
                                                          compile_device(dev)) is None
    if gluon_first:
        g, beta = _gluon_float(g), _gluon_float(beta)
    # du in bf16 where the Gluon reverse scan writes it, as FLA keeps it (half the scan's largest store and the
    # intra-chunk backward's read, docs/PERFORMANCE.md); else fp32: a bf16 du rounds every term of dbeta = v . du,
    # a sum that may cancel (GPU fuzz seed 285: dbeta 1.5x over the error rule with it)
    scan_gluon = N > 0 and _scan_fused_unsupported(q, v, compile_device(dev)) is None
    DU = torch.empty(R, HV, V, dtype=prec.work if scan_gluon else f32, device=dev)
    DH = torch.empty(HS.shape, dtype=prec.work, device=dev)
    DQG = torch.empty(R, HV, K, dtype=f32, device=dev)
    DKD, DW = (torch.empty(R, HV, K, dtype=f32, device=dev) for _ in range(2))
    DAQK = torch.empty(R, HV, bt, dtype=f32, device=dev)
    DGC = torch.empty(GC.shape, dtype=f32, device=dev)
    dh0 = empty((N, HV, K, V), f32, dev) if initial_state is not None else None
    with compiled_together():        # the stages' kernels compile concurrently on first use
        # 1. reverse state scan: du and the chunk-end state gradients (Gluon where it runs)
        if scan_gluon:
            launch(_kda_bwd_scan_fused_kernel, lambda t: (V // t.get("BV"), N, HV),
                   (W, QG, KD, AQK, GC, do, optional(dht, q), ch.seq_t, DU, optional(dh0, q), DH, HV),
                   dict(K=K, V=V, BT=bt, USE_DHT=dht is not None, STORE_DH0=dh0 is not None),
                   scan_fused_tiles(N * HV, compile_device(dev)))
        elif N > 0:
            launch(_kda_bwd_scan_kernel, lambda t: (triton.cdiv(V, t.get("BV")), N, HV),
                   (W, QG, KD, AQK, GC, do, optional(dht, q), ch.seq_t, DU, optional(dh0, q), DH, HV, ch.ncmax),
                   dict(K=K, V=V, BT=bt, USE_DHT=dht is not None, STORE_DH0=dh0 is not None, PREC=prec.scan),
                   scan_tiles(K, V, N * HV, bt, 64, 8, 2))
        # 2. per-chunk gradients of the scan's operands (in the Gluon domain, formed inside the factored launch of
        #    stage 3, which writes them for the flagged chunks only: the EXACT launch's inputs)
        if NC > 0 and not gluon_first:
            launch(_kda_bwd_chunk_grads_kernel, lambda t: (NC, HV, triton.cdiv(K, t.get("BKB"))),
                   (HS, DH, VNEW, do, DU, ch.chunk_t, DQG, DKD, DW, DAQK, DGC, HV),
                   dict(K=K, V=V, BT=bt, PREC=prec.scan), chunk_grads_tiles(K, V))
        # 3. intra-chunk backward (factored everywhere, then the flagged chunks exactly)
        # dq, dk in q / k's dtype without GVA (else fp32, summed below); fp32 scratch where read (l2 norm, Gluon's dk)
        G = HV // H
        dq_o, dk_o = (empty((B, T, HV, K), x.dtype if G == 1 else f32, dev) for x in (q, k))
        dq_h = empty((B, T, HV, K), f32, dev) if use_qk_l2norm else dq_o
        dk_h = empty((B, T, HV, K), f32, dev) if use_qk_l2norm or gluon_first else dk_o
        dv = empty((B, T, HV, V), v.dtype, dev)
        db, dg = empty((B, T, HV), f32, dev), empty((B, T, HV, K), f32, dev)
        dal = torch.zeros(NC, HV, dtype=f32, device=dev)
        ddt = torch.empty(NC, HV, K, dtype=f32, device=dev) if dt_bias is not None else None
        if NC > 0:
            gate_ptrs, gate_kw = _gate_args(A_log, dt_bias, lower_bound, q)
            flags = torch.zeros(NC, HV, dtype=torch.int32, device=dev)
            for exact in (False, True):
                if gluon_first and not exact:   # the factored launch in Gluon; the flagged chunks as below
                    launch(_kda_bwd_intra_fused_kernel, lambda t: (NC, HV),
                           (q, k, v, g, beta, ch.chunk_t, TM, DU, HS, DH, VNEW, do.to(prec.work), DQG, DKD, DW, DAQK,
                            DGC, dq_h, dk_h, dq_o, dk_o, dv, db, dg, flags, float(scale), H, HV),
                           dict(K=K, V=V, BT=bt, BK=FUSED_BWD_BK, BV=FUSED_BWD_BV, L2NORM=bool(use_qk_l2norm),
                                FLOOR=DECAY_FLOOR, FACTOR_MAX=FACTOR_MAX, W=FUSED_BWD_WARPS,
                                GBITS=8 * g.element_size()),
                           (BWD_INTRA_FUSED_TILES,))
                    continue
                launch(_kda_bwd_intra_kernel, lambda t: (NC, HV),
                       (q, k, v, g, beta) + gate_ptrs + (ch.chunk_t, TM, DU, DQG, DKD, DW, DAQK, DGC, dq_h, dk_h, dq_o,
                                                        dk_o, dv, db, dg, dal, optional(ddt, q), flags, float(scale),
                                                        float(lower_bound or 0.0), H, HV),
                       dict(K=K, V=V, BT=bt, BC=16, L2NORM=use_qk_l2norm, FLOOR=DECAY_FLOOR, FACTOR_MAX=FACTOR_MAX,
                            TANGENT_MAX=TANGENT_MAX, DOT_PREC=prec.dot, ROUND_TF32=prec.dot == "tf32", EXACT=exact,
                            TWO_FLOAT=prec.two_float, **gate_kw),
                       bwd_intra_tiles(K, V))
    if dev.type == "meta":           # compiled only (_compile_backward): no gradient was computed
        return None
    # GVA: the query / key heads' gradients are the sums over their value heads
    dq = dq_o.view(B, T, H, G, K).sum(3).to(q.dtype) if G > 1 else dq_o
    dk = dk_o.view(B, T, H, G, K).sum(3).to(k.dtype) if G > 1 else dk_o
    # the gate parameters' gradients: sums of the per-chunk partials (dal, ddt) the intra-chunk backward formed
    dA_log = dal.sum(0) if A_log is not None else None
    ddt = ddt.sum(0).reshape(-1) if dt_bias is not None else None
    return dq, dk, dv, dg.to(g_dtype), db.to(beta_dtype), dh0, dA_log, ddt


# ---- decode --------------------------------------------------------------------------------------------------------

def decode_step(q, k, v, g, beta, state, state_indices, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
                num_accepted_tokens=None, config: Optional[Tiles] = None):
    """Decode: updates ``state`` (P, HV, K, V) in place, returns o (B, T, HV, V). ``state_indices`` None, (B,)
    or (B, T) (speculative, with ``num_accepted_tokens`` (B,) or None): see ``kernels_decode.py``. ``config``: the
    launch config (``BV``, warps; default :func:`step_tiles`). No host synchronisation: capturable."""
    q, k, v, g, beta, A_log, dt_bias = map(param, (q, k, v, g, beta, A_log, dt_bias))
    state_indices, num_accepted_tokens = index(state_indices), index(num_accepted_tokens)
    if not state.is_contiguous():
        # the kernel addresses the pool as contiguous: step on a contiguous copy, then write it back in place
        work = state.contiguous()
        o = decode_step(q, k, v, g, beta, work, state_indices, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
                        num_accepted_tokens, config)
        state.copy_(work)
        return o
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = empty((B, T, HV, V), v.dtype, q.device)
    if B > 0:
        config = config or step_tiles(K, V)
        KP = next_pow2(K)
        gate_ptrs, gate_kw = _gate_args(A_log, dt_bias, lower_bound, q)
        idx_mode = 0 if state_indices is None else state_indices.dim()
        candidates = halving(config, ("BV",))
        kernel = _kda_step_kernel
        if gluon_available(q.device):      # the same program with an explicit layout per block size
            kernel = _kda_step_kernel_gluon
            candidates = _with_layouts(candidates, state.element_size())
        launch(kernel, lambda t: (cdiv(V, t.get("BV")), B, HV),
               (q, k, v, g, beta) + gate_ptrs + (state, optional(state_indices, q),
                                                 optional(num_accepted_tokens, q), o,
                                                 float(scale), float(lower_bound or 0.0), T, H, HV),
               dict(K=K, V=V, KP=KP, L2NORM=use_qk_l2norm, IDX=idx_mode, HAS_NAT=num_accepted_tokens is not None,
                    EVEN=KP == K and V % config.get("BV") == 0, **gate_kw),
               candidates)
    return o


@functools.lru_cache(maxsize=64)
def _with_layouts(candidates, state_bytes: int):
    """Each decode-step candidate with its Gluon register layout (``decode.step_layout``) as the LAYOUT constexpr."""
    return tuple(t.with_(LAYOUT=step_layout(t.get("BV"), t.num_warps, state_bytes)) for t in candidates)
