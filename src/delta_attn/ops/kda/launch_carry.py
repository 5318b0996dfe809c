"""Host side of the carry (context parallelism, ``distributed/kda_triton.py``): rows run from state 0 with their
transition, the true start state folded in afterwards. The state after a shard's piece of a sequence is affine in the
state before it, ``S_out = M S_in + B``, and so is each output, ``o_t = o_t(0) + u_t S_in`` (``kernels_carry.py``,
``kernels_scan.py``'s TRANSITION): ``cp_forward`` (either forward, then the transition's scan of the carried rows on
the same operands), ``cp_fold_carry`` (the carry added to outputs, final states and saved tensors) and
``cp_carry_grad`` (its gradient from the outputs); the chunk tables come from the plan.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch

from ..._outputs import empty
from .._launch import cdiv, compiled_together, halving, launch, next_pow2, optional, sm_count, tiles, unit_last
from .kernels_carry import _kda_carry_add_kernel, _kda_carry_grad_kernel
from .kernels_scan import _kda_fwd_scan_kernel
from .launch import Chunks, Saved, _compile_backward, _forward, precision, scan_tiles


class Transition(NamedTuple):
    """The transition's scan of the carried rows (their first T1 tokens; ``kernels_scan.py``, TRANSITION)."""
    u: torch.Tensor                  # (n T1, HV, K), v's dtype: o_t(S) = o_t(0) + u_t S
    m: torch.Tensor                  # (n, HV, K, K) fp32: the final state S_end = M S + B
    HS: Optional[torch.Tensor]       # training: (n ceil(T1 / 64), HV, K, K) its chunk-start states
    VNEW: Optional[torch.Tensor]     # training: (n T1, HV, K) its v_new (-W S)


def cp_forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
               allow_tf32, train: bool, chunks: Callable[[int], Chunks], carried: int, carried_len: int):
    """Context parallelism's local pass (``distributed/kda_triton.py``): the forward (the training pipeline when
    ``train``, else the inference one) with the final state of every row, the ``carried`` first rows started from 0
    (``initial_state`` rows of 0 or None), then, when ``carried`` > 0, the transition's scan of their first
    ``carried_len`` tokens on the same intra-chunk operands: zero values, the identity as initial state, K columns.
    ``chunks``: the plan's chunk tables per chunk length. Returns (o, finals, Saved (training: the backward's; else
    the operands alone), Transition or None). As :func:`train_forward`, the first call of a specialisation compiles
    its kernels and the backward's concurrently."""
    with compiled_together():
        o, final, saved = _forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound,
                                   use_qk_l2norm, True, allow_tf32, train, chunks=chunks, keep_operands=True)
        tr = _transition_scan(q, v, saved, chunks, carried, carried_len, allow_tf32, train) if carried else None
        if train:
            _compile_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, o, final, saved, scale,
                              lower_bound, use_qk_l2norm, allow_tf32, chunks=chunks)
    return o, final, saved, tr


def _transition_scan(q, v, saved: Saved, chunks, carried: int, carried_len: int, allow_tf32: bool,
                     train: bool) -> Transition:
    R, HV, K = saved.W.shape
    bt, dev = saved.AQK.shape[-1], q.device
    prec = precision(q.dtype, allow_tf32, K, train)
    ch, ncr = chunks(bt), cdiv(carried_len, bt)
    rows = Chunks(ch.seq_t[:carried], ch.chunk_t[:carried * ncr], ncr, bt)     # their chunks come first
    u = empty((carried * carried_len, HV, K), v.dtype, dev)
    m = empty((carried, HV, K, K), torch.float32, dev)
    HS = torch.empty(carried * ncr, HV, K, K, dtype=prec.work, device=dev) if train else None
    VNEW = torch.empty(carried * carried_len, HV, K, dtype=prec.work, device=dev) if train else None
    launch(_kda_fwd_scan_kernel, lambda t: (cdiv(K, t.get("BV")), carried, HV),
           (saved.W, optional(None, q), saved.QG, saved.KD, saved.AQK, saved.GC, optional(None, q), rows.seq_t, u,
            optional(VNEW, q), optional(HS, q), m, HV, rows.ncmax),
           dict(K=K, V=K, BT=bt, USE_H0=False, STORE_FINAL=True, STORE_H=train, PREC=prec.fwd_scan, TRANSITION=True),
           scan_tiles(K, K, carried * HV, bt, 256, 4, 2 if train else 3))
    return Transition(u, m, HS, VNEW)


@functools.lru_cache(maxsize=None)
def carry_tiles(K: int, V: int):
    first = tiles("rows x K in fp32 against a K x BV state block", num_warps=4 if next_pow2(K) <= 128 else 8, BR=64,
                  BV=min(64, next_pow2(V)))
    return halving(first, ("BV", "BR"))


def _carry_add(x, x_strides, y, y_strides, carry, rows: int, blocks: int, per_carry: int, prec: str):
    """x[b, h, r] += y[b, h, r] carry[b // per_carry, h] for rows r < ``rows`` of blocks b < ``blocks``
    (``kernels_carry.py``; strides (block, head, row))."""
    n, HV, K, V = carry.shape
    launch(_kda_carry_add_kernel, lambda t: (cdiv(rows, t.get("BR")), blocks * HV, cdiv(V, t.get("BV"))),
           (x, y, carry, rows, per_carry, HV) + tuple(x_strides) + tuple(y_strides),
           dict(K=K, V=V, KP=next_pow2(K), PREC=prec), carry_tiles(K, V))


def cp_fold_carry(o, final, saved: Saved, tr: Transition, carry, allow_tf32: bool):
    """The carry (n, HV, K, V) fp32 of the n carried rows added, in place, to what :func:`cp_forward` computed
    from 0: ``o += u S`` on their first T1 tokens, their final states ``+= M S`` and, training, the saved v_new
    and chunk-start states (``+= VNEW' S``, ``+= HS' S``), so the backward is the plain one at the true
    initial state."""
    n, HV, K, V = carry.shape
    T, t1 = o.shape[1], tr.u.shape[0] // n
    prec = precision(o.dtype, allow_tf32, K, saved.TM is not None).fwd_scan
    rows_x, rows_y = (T * HV * V, V, HV * V), (t1 * HV * K, K, HV * K)
    _carry_add(o, rows_x, tr.u, rows_y, carry, t1, n, 1, prec)
    final[:n] += torch.matmul(tr.m, carry)
    if tr.VNEW is not None:
        _carry_add(saved.VNEW, rows_x, tr.VNEW, rows_y, carry, t1, n, 1, prec)
        ncr = tr.HS.shape[0] // n
        _carry_add(saved.HS, (HV * K * V, K * V, V), tr.HS, (HV * K * K, K * K, K), carry, K, n * ncr, ncr, prec)


def cp_carry_grad(u, do, carried: int, dtype: torch.dtype, allow_tf32: bool):
    """The carry's gradient from the outputs, ``sum_t u_t^T do_t`` (n, HV, K, V) fp32 over the first T1 tokens of
    the n = ``carried`` first rows (u (n T1, HV, K); do (B, T, HV, V), any strides but the last), in row splits
    (``kernels_carry.py``)."""
    do = unit_last(do)
    HV, K, V = u.shape[1], u.shape[2], do.shape[3]
    n, t1 = carried, u.shape[0] // carried
    first = carry_tiles(K, V)[0]
    blocks = n * HV * cdiv(V, first.get("BV"))
    rps = cdiv(cdiv(t1, max(1, min(cdiv(t1, first.get("BR")), cdiv(2 * sm_count(do.device), blocks)))),
               first.get("BR")) * first.get("BR")
    splits = cdiv(t1, rps)
    partial = torch.empty(splits, n, HV, K, V, dtype=torch.float32, device=do.device)
    launch(_kda_carry_grad_kernel, lambda t: (splits, n * HV, cdiv(V, t.get("BV"))),
           (u, do, partial, t1, rps, n, HV, t1 * HV * K, K, HV * K, do.stride(0), do.stride(2), do.stride(1)),
           dict(K=K, V=V, KP=next_pow2(K), PREC=precision(dtype, allow_tf32, K, True).scan), carry_tiles(K, V))
    return partial.sum(0)
