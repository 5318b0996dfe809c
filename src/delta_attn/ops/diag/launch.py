"""Host launchers of the gated diagonal kernels (``backend="triton"``): configs, grids, what each kernel
receives.

``diag_fwd`` / ``diag_bwd`` launch the single-pass decoupled look-back scans of ``kernels_scan.py`` with the
configs chosen below (:data:`FWD_CONFIG`, :data:`BWD_CONFIG`: measured fastest, docs/PERFORMANCE.md);
``diag_step`` launches the decode step of ``kernels_decode.py``; ``diag_summary`` context parallelism's
per-piece summaries of ``kernels_summary.py`` (:data:`SUMMARY_CONFIG`, not measured). The forward returns,
besides ``o`` and the final states, its workspace: the state at the end of every time tile (of every segment
for a training forward), which the backward uses as carries (int64 words, 8 bytes per channel every ``bt``
or, training, every ``bt / split`` tokens). The custom ops, the autograd Function and the backend entries over
these launchers are in ``autograd.py``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton

from ... import settings
from ..._outputs import empty
from .._launch import Tiles, cdiv, index, launch, next_pow2, optional, param, sm_count, tiles
from .kernels_decode import _diag_step_kernel
from .kernels_scan import _diag_bwd_rows_kernel, _diag_fwd_rows_kernel
from .kernels_summary import _diag_summary_combine_kernel, _diag_summary_kernel


@dataclass(frozen=True)
class FwdConfig:
    """The forward's launch config (``_diag_fwd_rows_kernel``)."""
    bt: int       # time rows per tile (a power of two)
    bd: int       # channels of the flattened H * D axis per program (a power of two); shrunk for small problems
    w: int        # look-back window (words read per probe)
    warps: int
    split: int    # time segments per tile walked side by side (bt / split rows each, on their own threads;
                  # their maps combined once per tile): a power of two > 1 dividing bt

    def __post_init__(self):
        if self.split < 2 or self.split & (self.split - 1) or self.bt % self.split:
            raise ValueError(f"split must be a power of two > 1 dividing bt ({self.bt}), got {self.split}")

    @property
    def segment_rows(self) -> int:
        """Rows per carry of a training forward (its workspace): bt / split."""
        return self.bt // self.split


@dataclass(frozen=True)
class BwdConfig:
    """The backward's launch config (``_diag_bwd_rows_kernel``)."""
    bt: int       # time rows per tile (a power of two; a multiple of the forward's carry rows)
    bd: int       # channels of the flattened H * D axis per program (a power of two); shrunk for small problems
    w: int        # look-back window
    warps: int


# Defaults: the fastest correct configs measured on the H200, bf16, H=16, D=128 (docs/PERFORMANCE.md):
# - forward: 64 rows x 64 channels walked as 4 segments of 16 rows on 4 warps, look-back window 4:
#   0.191 ms at 1x32768 (82 % of copy). Few tiles of a chain in flight is what made the look-back cheap;
# - training: the same forward writing its states every 16 rows (the segments' ends) as the carries of
#   the backward, 16 x 128 on two warps (the backward's tile must be a multiple of the forward's
#   segment_rows). The interpreter uses tiny tiles of the same kernels.
FWD_CONFIG = FwdConfig(bt=64, bd=64, w=4, warps=4, split=4)
BWD_CONFIG = BwdConfig(bt=16, bd=128, w=8, warps=2)
INTERP_FWD_CONFIG = FwdConfig(bt=8, bd=16, w=2, warps=2, split=2)
INTERP_BWD_CONFIG = BwdConfig(bt=16, bd=16, w=2, warps=1)


def _configs() -> Tuple[FwdConfig, BwdConfig]:
    """(forward, backward): the inference and the training forward share their config."""
    if settings.triton_interpreter():
        return INTERP_FWD_CONFIG, INTERP_BWD_CONFIG
    return FWD_CONFIG, BWD_CONFIG


def _block_hd(bd: int, n_tiles: int, hd: int, device: torch.device) -> int:
    """Channel blocks over the flattened H * D axis, shrunk while the grid would not fill the GPU twice."""
    bd = min(bd, triton.next_power_of_2(hd))
    while bd > 16 and n_tiles * triton.cdiv(hd, bd) < 2 * sm_count(device):
        bd //= 2
    return bd


def _log_n(n: int) -> int:
    return max(1, math.ceil(math.log2(max(n, 1))) + 1)


def _even(cu_seqlens, t_seq: int, total: int, d: int, bt: int, bd: int) -> bool:
    """No boundary masks needed and every tile inside one sequence (fixed length, T % BT == 0)."""
    return cu_seqlens is None and t_seq % bt == 0 and total % bt == 0 and d % bd == 0


def _shape(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]):
    b, t, h, d = q.shape
    n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else b
    return b * t, t, n, h, d


def _launch_scan(kernel, cfg, split: int, device, n_tiles: int, h: int, d: int, n: int, t_seq: int, total: int,
                 cu_seqlens, args: tuple, meta: dict) -> None:
    """Launch one direction's scan: channel blocks of the flattened H * D axis (``split`` segments per
    tile: 1 for the backward)."""
    bd = _block_hd(cfg.bd, n_tiles, h * d, device)
    # no more warps than a program's channel vector ([bd * split]) fills: a look-back whose copies sat in
    # two warps could leave its loop on one copy's reduction while another copy is still walking
    warps = min(cfg.warps, max(1, bd * split // 32))
    meta = dict(meta, FAST_EXP=not settings.triton_interpreter(), H=h, D=d, IS_VARLEN=cu_seqlens is not None,
                LOG_N=_log_n(n), BT=cfg.bt, BD=bd, W=cfg.w, EVEN=_even(cu_seqlens, t_seq, total, h * d, cfg.bt, bd),
                num_warps=warps)
    kernel[(n_tiles * triton.cdiv(h * d, bd),)](*args, **meta)


def _carry_words(cfg: FwdConfig, total: int, training: bool) -> int:
    """Words per channel of the forward's workspace: one per tile, or in training one per segment
    (``cfg.segment_rows`` rows: what the backward reads as carries)."""
    return triton.cdiv(total, cfg.bt) * (cfg.split if training else 1)


def diag_fwd(q, k, v, g, initial_state=None, cu_seqlens=None, output_final_state=False,
             config: Optional[FwdConfig] = None, training: bool = False):
    """Forward scan. q, k, v, g (B, T, H, D). Returns ``(o, final_state, workspace)``;
    ``final_state`` is (N, H, D) float32 or an empty tensor when not requested. ``config``: default
    :data:`FWD_CONFIG` (tests and sweeps pass others). With ``training`` the workspace holds the state
    every ``cfg.segment_rows`` rows (what the backward expects by default); otherwise every ``cfg.bt``
    rows."""
    q, k, v, g, initial_state = map(param, (q, k, v, g, initial_state))
    cu_seqlens = index(cu_seqlens)
    total, t_seq, n, h, d = _shape(q, cu_seqlens)
    cfg = config or _configs()[0]
    n_tiles = triton.cdiv(total, cfg.bt)
    o = empty(q.shape, q.dtype, q.device)
    ws = torch.zeros((n_tiles, h, d), dtype=torch.int64, device=q.device)
    carries = empty((_carry_words(cfg, total, True), h, d), torch.int64, q.device) if training else ws
    final = empty((n, h, d) if output_final_state else (0,), torch.float32, q.device)
    if total == 0:
        if output_final_state:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return o, final, carries
    _launch_scan(_diag_fwd_rows_kernel, cfg, cfg.split, q.device, n_tiles, h, d, n, t_seq, total, cu_seqlens,
                 (q, k, v, g, o, optional(initial_state, ws), optional(final if output_final_state else None, ws),
                  ws, optional(cu_seqlens, ws),
                  max(t_seq, 1), total, n, n_tiles),
                 dict(HAS_H0=initial_state is not None, STORE_FINAL=output_final_state, SPLIT=cfg.split,
                      carries=carries, STORE_CARRIES=training))
    return o, final, carries


def diag_bwd(q, k, v, g, do, ws, initial_state=None, dfinal=None, cu_seqlens=None,
             config: Optional[BwdConfig] = None, fwd_bt: Optional[int] = None):
    """Backward scan on the forward's workspace ``ws``, which holds the state every ``fwd_bt`` rows
    (default: the training forward's ``segment_rows``). ``config``: default :data:`BWD_CONFIG`.
    Returns ``(dq, dk, dv, dg, d_initial_state or an empty tensor)``."""
    q, k, v, g, do, initial_state, dfinal = map(param, (q, k, v, g, do, initial_state, dfinal))
    cu_seqlens = index(cu_seqlens)
    total, t_seq, n, h, d = _shape(q, cu_seqlens)
    cfg = config or _configs()[1]
    fbt = fwd_bt or _configs()[0].segment_rows
    if cfg.bt % fbt != 0:
        raise ValueError(f"the backward tile ({cfg.bt}) must be a multiple of the forward's carry rows ({fbt})")
    dq = empty(q.shape, q.dtype, q.device)
    dk = empty(k.shape, k.dtype, k.device)
    dv = empty(v.shape, v.dtype, v.device)
    dg = empty(g.shape, g.dtype, g.device)
    dh0 = empty(initial_state.shape if initial_state is not None else (0,),
                initial_state.dtype if initial_state is not None else torch.float32, q.device)
    if total == 0:
        if initial_state is not None:
            dh0.copy_(dfinal if dfinal is not None else torch.zeros_like(dh0))
        return dq, dk, dv, dg, dh0
    n_tiles = triton.cdiv(total, cfg.bt)
    ws_b = torch.zeros((n_tiles, h, d), dtype=torch.int64, device=q.device)
    _launch_scan(_diag_bwd_rows_kernel, cfg, 1, q.device, n_tiles, h, d, n, t_seq, total, cu_seqlens,
                 (q, k, v, g, do, dq, dk, dv, dg, optional(initial_state, ws), optional(dfinal, ws),
                  optional(dh0 if initial_state is not None else None, ws), ws, ws_b, optional(cu_seqlens, ws),
                  max(t_seq, 1), total, n, n_tiles, cfg.bt // fbt),
                 dict(HAS_H0=initial_state is not None, HAS_DHT=dfinal is not None))
    return dq, dk, dv, dg, dh0


@dataclass(frozen=True)
class SummaryConfig:
    """The launch config of context parallelism's summary (``_diag_summary_kernel``): BT rows unrolled per
    step, BD channels per program, and enough chunks of each segment that the grid has ``programs_per_sm``
    programs per SM (chunks of at least ``min_chunk_steps`` steps; more chunks: one combine launch)."""
    bt: int
    bd: int
    warps: int
    programs_per_sm: int
    min_chunk_steps: int


# Not measured yet (a first choice: 128 channels on 4 warps, 16 rows of three operands in flight per step,
# chunks of >= 128 rows, about 4 programs per SM)
SUMMARY_CONFIG = SummaryConfig(bt=16, bd=128, warps=4, programs_per_sm=4, min_chunk_steps=8)
INTERP_SUMMARY_CONFIG = SummaryConfig(bt=4, bd=16, warps=1, programs_per_sm=1, min_chunk_steps=1)


def diag_summary(x, y, g, t0: int, t1: int, edge=None, reverse: bool = False,
                 config: Optional[SummaryConfig] = None):
    """Context parallelism's per-channel summary of rows [t0, t1) of every batch row of x, y, g (B, T, H, D),
    one read of the three (no output the size of the inputs). Returns ``(decay, s)`` (B, H, D) float32, decay =
    prod exp(g) over the rows and

    - forward (x, y = k, v): s = the state after the rows from ``edge`` (B, H, D; 0 when None);
    - ``reverse`` (x, y = q, do): s = d state before the rows of sum_t <do_t, q_t s_t> + <edge, s_last>, i.e.
      ``sum_t exp(g_t0 + .. + g_t) q_t do_t + decay * edge``.

    No host synchronisation: ``t0``, ``t1`` are host ints (a plan's)."""
    x, y, g, edge = map(param, (x, y, g, edge))
    b, t, h, d = x.shape
    hd = h * d
    out_m = torch.empty((b, h, d), dtype=torch.float32, device=x.device)
    out_s = torch.empty((b, h, d), dtype=torch.float32, device=x.device)
    rows = t1 - t0
    if rows <= 0 or b == 0:
        out_m.fill_(1.0)
        if edge is not None:
            out_s.copy_(edge)
        else:
            out_s.zero_()
        return out_m, out_s
    cfg = config or (INTERP_SUMMARY_CONFIG if settings.triton_interpreter() else SUMMARY_CONFIG)
    bd = min(cfg.bd, next_pow2(hd))
    n_cb = cdiv(hd, bd)
    want = max(1, cdiv(cfg.programs_per_sm * sm_count(x.device), b * n_cb))
    n_chunks = max(1, min(want, rows // (cfg.bt * cfg.min_chunk_steps)))
    chunk_rows = cdiv(cdiv(rows, n_chunks), cfg.bt) * cfg.bt
    n_chunks = cdiv(rows, chunk_rows)
    single = n_chunks == 1
    part = out_m if single else torch.empty((b, n_chunks, 2, h, d), dtype=torch.float32, device=x.device)
    meta = dict(HD=hd, BD=bd, REVERSE=reverse, HAS_EDGE=edge is not None, num_warps=max(1, min(cfg.warps, bd // 32)))
    _diag_summary_kernel[(b * n_chunks, n_cb)](x, y, g, optional(edge, out_m), out_m, out_s, part, t, t0, t1,
                                               chunk_rows, n_chunks, BT=cfg.bt, SINGLE=single, **meta)
    if not single:
        _diag_summary_combine_kernel[(b, n_cb)](part, optional(edge, out_m), out_m, out_s, n_chunks, **meta)
    return out_m, out_s




STEP_WIDE_CHANNELS = 2 ** 21     # B * H * D from which the step takes 2048-channel programs


@functools.lru_cache(maxsize=None)
def step_tiles(hd: int, wide: bool) -> Tiles:
    """The decode step's launch config: BD channels of the flattened H * D axis per program (B x HD / BD
    programs) and warps; ``wide``: B * HD >= STEP_WIDE_CHANNELS (H200 sweep, bf16, H * D = 2048, graph
    replay, L2 flushed: at B = 4096 / 16384, 2048-channel programs on 4 warps take 41.9 / 144.7 us, 85 % / 98 %
    of the copy ceiling in all bytes moved, where 128-channel ones took 47.6 / 170.0 us; below 2M channels
    the step is latency-bound and 512 channels on 4 warps are within 2 % of the best (B = 64: 5.7-5.9 us,
    B = 256: 7.87 us, a same-size copy 5.5 / 7.65 us))."""
    bd = min(2048 if wide else 512, next_pow2(hd))
    return tiles("by channel count: 2048 channels on 4 warps from 2M channels, else 512 (H200 sweep)",
                 num_warps=max(1, min(4, bd // 32)), BD=bd)


def diag_step(q, k, v, g, state, state_indices=None, num_accepted_tokens=None, config: Optional[Tiles] = None):
    """Decode: the recurrence over q.shape[1] new tokens per sequence; ``state`` (P, H, D) updated in place.
    ``state_indices`` None, (B,) or (B, T) (speculative, with ``num_accepted_tokens``): see ``ops/_slots.py``;
    index tensors may be strided views (the launch layer gives the kernel contiguous int32 copies).
    ``config``: the launch config (``BD``, warps; default :func:`step_tiles`). No host synchronisation."""
    if not state.is_contiguous():
        # the kernel addresses the pool as contiguous: step on a contiguous copy, then write it back in place
        work = state.contiguous()
        o = diag_step(q, k, v, g, work, state_indices, num_accepted_tokens, config)
        state.copy_(work)
        return o
    q, k, v, g = map(param, (q, k, v, g))
    state_indices, num_accepted_tokens = index(state_indices), index(num_accepted_tokens)
    b, t, h, d = q.shape
    o = empty(q.shape, q.dtype, q.device)
    if b == 0 or t == 0:
        return o
    config = config or step_tiles(h * d, b * h * d >= STEP_WIDE_CHANNELS)
    launch(_diag_step_kernel, lambda c: (b, cdiv(h * d, c.get("BD"))),
           (q, k, v, g, o, state, optional(state_indices, state),
            optional(num_accepted_tokens, state), t, h * d),
           dict(IDX=0 if state_indices is None else state_indices.dim(), HAS_NAT=num_accepted_tokens is not None,
                EVEN=(h * d) % config.get("BD") == 0),
           (config,))
    return o
