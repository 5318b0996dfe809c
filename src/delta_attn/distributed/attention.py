"""Context-parallel flash attention: every rank holds a shard of the sequence (of the packed tokens for
varlen) and computes the attention of its own queries.

Scheme: all-gather of K/V, then exact single-GPU calls.
1. K and V of this rank (only the Hk key heads under GQA) are packed into one buffer and all-gathered;
   the gathered shards are put back in global token order (contiguous or zigzag layout).
2. Each local query chunk (one, or two under zigzag) is one call of ``da.flash_attn_func`` /
   ``da.flash_attn_varlen_func`` on a *slice of the global keys chosen so that the op's bottom-right
   alignment lands on the global diagonal*: for query chunk [qs, qe) the keys are [qs - wl, qe + wr]
   clipped to the sequence, and the window bounds are shifted by ``b - qe`` where the slice ends at b.
   Causal: keys [0, qe) (or from qs - wl), so masked blocks are never computed (the causal saving; the
   zigzag layout gives every rank the same number of unmasked pairs). Varlen: the sequences crossing a
   chunk become one varlen call with local cu_seqlens (sequences may span ranks); the one sequence
   running past the chunk end, when it needs a shifted window, is a call of its own. With
   cu_seqlens_k != cu_seqlens_q the diagonal of sequence s is j = i + Sk_s - Sq_s: the same rule with
   key positions offset by Sk_s - Sq_s (q and k are sharded separately; the keys are gathered whole).
   Dense is planned as a packed batch of one sequence of Sq queries and Sk keys (every batch row alike).
3. ALiBi needs the local diagonal to be the global one (the op's bias is ``slope * |i + Sk - Sq - j|``).
   That holds for every call above except keys past the chunk end without a causal mask; there the keys
   are split: the lower part [.., qe) is an aligned call with right bound 0, the upper part (j > i) is a
   call on the reversed rows and keys (where it becomes a lower part, one step below the diagonal, so
   its LSE is corrected by one slope), and the two are merged by their LSE in fp32
   (``out = sum_b exp(lse_b - lse) out_b``). The merge's backward needs the LSE to be differentiable:
   it is on every backend that takes ALiBi (``torch``, ``triton``); a backend whose LSE had no
   gradient would raise instead of returning a wrong gradient.
4. Overlap: the key heads are split into ``PIPELINE_GROUPS`` groups; the gather of group g + 1 is in
   flight while group g computes, and in the backward the reduce-scatter of group g's dK/dV runs while
   group g - 1's backward computes. The first group's gather and the last reduce-scatter are exposed.
5. Backward: one autograd graph per head group (built in the forward), so every option the backend
   differentiates is differentiated here; dK/dV of the gathered keys go back to their owners by a
   reduce-scatter (sum over ranks).

Communication per rank and call (W ranks, local keys Tl, batch B, key heads Hk, element size e):
the forward's all-gather of K and V sends and receives (W - 1) * B * Tl * Hk * (D + Dv) * e bytes (NCCL's
ring all-gather); the backward's reduce-scatter of dK, dV moves the same volume again (gloo, which has no
reduce-scatter here, all-reduces: about twice that). Nothing else crosses ranks: Q, O and dO stay local.
Memory: the gathered K/V (B, T, Hk, D + Dv) of every head group stay alive for the backward.

Why all-gather rather than a ring of K/V blocks: each call keeps the single-GPU op's own masks, so
every option and backend runs unchanged (windows, ALiBi, varlen with sequences spanning ranks, GQA,
head_dim_v) and its backward is the op's backward; a ring needs per-block diagonal offsets the kernels
do not take (ALiBi's distance in particular) and the backend's forward/backward with a global LSE. With
GQA the gathered K/V are Hq / Hk times smaller than Q. The cost is memory: the full K/V per rank.

Dropout is refused: the single-GPU op draws one mask over the whole (Sq, Sk) score matrix from one
seed, and per-rank calls cannot reproduce it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import _checks as C
from ..ops.flash import api as flash_api
from ..reference import accumulation_dtype
from ._comm import group_rank_world
from .plan import Plan, prepare, resolve, upload
from .sharding import check_layout, chunk_ranges, local_length

# key-head groups whose gathers are pipelined with the attention of the previous group: 2 keeps every
# attention launch at half the heads (still large) while half of the gather is hidden
PIPELINE_GROUPS = 2


# ---------------------------------------------------------------------------------------------
# planning: which single-GPU calls compute a rank's rows (host integers only)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """One single-GPU call: local query rows [r0, r1) against global keys [k0, k1)."""
    rows: Tuple[int, int]
    keys: Tuple[int, int]
    window: Tuple[int, int]                     # for the call's own (bottom-right) alignment
    reversed: bool = False                      # rows and keys reversed (upper part of an ALiBi split)
    cu: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None    # local cu_seqlens (q, k), varlen
    seqs: Tuple[int, int] = (0, 1)              # sequences [n0, n1) of the call (ALiBi (N, H) rows)


def _span_calls(p0: int, p1: int, sq: int, sk: int, wl: int, wr: int, alibi: bool, row0: int, key0: int,
                seq: int) -> List[_Call]:
    """Calls for query positions [p0, p1) of one sequence of sq queries and sk keys: query i sees key j
    when i + sk - sq - wl <= j <= i + sk - sq + wr (bottom-right alignment).

    Returns one call, or with ALiBi and keys past the diagonal of row p1 - 1 two calls to merge (lower,
    reversed upper). A span whose rows see no key is one call on the empty key range ending at the
    aligned end (clipped to the sequence), so it can share a varlen call. ``row0`` / ``key0``: local
    row and global key index of position 0 of the sequence.
    """
    off = sk - sq
    a = min(sk, max(0, p0 + off - wl)) if wl >= 0 else 0
    b = min(sk, max(0, p1 + off + wr)) if wr >= 0 else sk
    rows = (row0 + p0, row0 + p1)
    if b <= a:                                  # no row sees a key: empty range, any window
        e = key0 + min(sk, max(0, p1 + off))
        return [_Call(rows, (e, e), (wl, wr), seqs=(seq, seq + 1))]
    shift = b - p1 - off                        # >= 0: keys past the diagonal of the last query row
    if shift == 0 or not alibi:
        win = (wl + shift if wl >= 0 else -1, wr - shift if wr >= 0 else -1)
        return [_Call(rows, (key0 + a, key0 + b), win, seqs=(seq, seq + 1))]
    # ALiBi: lower part (j <= i + off) aligned; upper part (i + off < j <= i + off + wr) reversed, its
    # top-left corner (row p0, key p0 + off + 1) one below the diagonal
    if p0 + off + 1 < 0:
        raise ValueError(
            f"alibi_slopes with keys after the diagonal (causal=False and window right bound != 0) cannot be "
            f"split at a shard boundary of q inside a sequence with more queries than keys + 1 (its diagonal "
            f"starts before its first key): sequence {seq} has {sq} queries and {sk} keys and is cut at query "
            f"{p0 if p0 > 0 else p1}. Use causal=True, a right window bound of 0, or put the sequence on one rank")
    upper = _Call(rows, (key0 + p0 + off + 1, key0 + b), (wr - 1 if wr >= 0 else -1, 0), reversed=True,
                  seqs=(seq, seq + 1))
    if p1 + off <= a:                           # no key on or below the diagonal
        return [upper]
    return [_Call(rows, (key0 + a, key0 + p1 + off), (wl, 0), seqs=(seq, seq + 1)), upper]


def plan_dense(chunks: Sequence[Tuple[int, int]], sq: int, sk: int, window: Tuple[int, int],
               alibi: bool) -> List[List[_Call]]:
    """Row blocks (one per chunk, in local order) for dense attention of sq queries over sk keys: every batch
    row is one sequence, so this is the packed plan of one sequence (its calls' ``cu`` unused)."""
    return plan_varlen(chunks, (0, sq), (0, sk), window, alibi)


def plan_varlen(chunks: Sequence[Tuple[int, int]], cu_q: Sequence[int], cu_k: Sequence[int],
                window: Tuple[int, int], alibi: bool) -> List[List[_Call]]:
    """Row blocks for a packed batch with global offsets ``cu_q`` (queries) and ``cu_k`` (keys); ``chunks``
    are this rank's ranges of packed queries. Per chunk, one varlen call for the sequences that end inside
    it (each sequence's keys run from its first key, or the first visible one for the sequence started
    before the chunk, to its last, so the op's bottom-right alignment is the sequence's own), and the calls
    of the sequence running past the chunk end when its window must shift."""
    wl, wr = window
    n = len(cu_q) - 1
    blocks, row = [], 0

    def span(s, qs, qe):
        p0, p1 = max(qs, cu_q[s]) - cu_q[s], min(qe, cu_q[s + 1]) - cu_q[s]
        return _span_calls(p0, p1, cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s], wl, wr, alibi,
                           row - qs + cu_q[s], cu_k[s], s)

    for qs, qe in chunks:
        if qe <= qs:
            continue
        first = max(s for s in range(n) if cu_q[s] <= qs < cu_q[s + 1])
        last = max(s for s in range(n) if cu_q[s] < qe <= cu_q[s + 1])
        tail = span(last, qs, qe)
        exact_tail = len(tail) == 1 and tail[0].window == (wl, wr)
        end = last + 1 if exact_tail else last          # sequences [first, end) share the op's window
        if end > first:
            k_start = (tail[0] if first == last else span(first, qs, qe)[0]).keys[0]
            k_end = tail[0].keys[1] if exact_tail else cu_k[end]
            q_bounds = [qs] + list(cu_q[first + 1:end]) + [qe if exact_tail else cu_q[end]]
            k_bounds = [k_start] + list(cu_k[first + 1:end]) + [k_end]
            if q_bounds[-1] > q_bounds[0]:
                blocks.append([_Call((row, row + q_bounds[-1] - qs), (k_start, k_end), (wl, wr),
                                     cu=(tuple(x - qs for x in q_bounds), tuple(x - k_start for x in k_bounds)),
                                     seqs=(first, end))])
        if not exact_tail:
            blocks.append(tail)
        row += qe - qs
    return blocks


# ---------------------------------------------------------------------------------------------
# running the calls of one head group
# ---------------------------------------------------------------------------------------------


def _offsets(call: _Call) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """The local cu_seqlens (q, k) of a varlen call (one sequence when the plan gave none)."""
    if call.cu is not None:
        return call.cu
    return (0, call.rows[1] - call.rows[0]), (0, call.keys[1] - call.keys[0])


@dataclass(frozen=True)
class _Layout:
    """This rank's calls for one batch and one set of mask options, planned once per plan (``Plan.cached``):
    the row blocks, the global order of the gathered key chunks, whether any rank merges by LSE, and
    (varlen) each call's cu_seqlens on the device with its longest sequences."""
    blocks: Tuple[Tuple[_Call, ...], ...]
    order: Tuple[Tuple[int, int, int], ...]     # global chunks: (source rank, local start, length)
    merges: bool                                # some rank merges ALiBi parts by LSE (the same on every rank)
    offsets: Dict[tuple, tuple]                 # _offsets(call) -> (cu_q, cu_k on the device, max_q, max_k)


def _layout(p: Plan, window: Tuple[int, int], alibi: bool) -> _Layout:
    """Plan every rank's calls (a refusal is raised on every rank alike, before any collective) and keep
    this rank's, with the device copies of their cu_seqlens (uploaded without a host synchronisation)."""
    def build():
        if p.varlen:
            plans = [plan_varlen(chunk_ranges(p.t_local, r, p.world, p.layout), p.cu_seqlens, p.cu_seqlens_k,
                                 window, alibi) for r in range(p.world)]
        else:
            plans = [plan_dense(chunk_ranges(p.t_local, r, p.world, p.layout), p.seqlen, p.seqlen_k, window, alibi)
                     for r in range(p.world)]
        blocks = tuple(tuple(b) for b in plans[p.rank])
        offsets = {}
        for call in (c for b in blocks for c in b):
            key = _offsets(call)
            if p.varlen and key not in offsets:
                cu_q, cu_k = key
                offsets[key] = (upload(cu_q, p.device), upload(cu_k, p.device),
                                max(b - a for a, b in zip(cu_q, cu_q[1:])), max(b - a for a, b in zip(cu_k, cu_k[1:])))
        return _Layout(blocks, _order(p.tk_local, p.world, p.layout), any(len(b) > 1 for q in plans for b in q),
                       offsets)
    return p.cached(("attention", window, alibi), build)


@dataclass(frozen=True)
class _Spec:
    """Everything but the tensors: options of the op, layout of the tensors, the planned calls, the group."""
    tdim: int                   # token dim of q/k/v: 1 dense, 0 "thd", 1 "htd"
    hdim: int                   # head dim index
    varlen_layout: Optional[str]
    layout: _Layout
    softmax_scale: float
    softcap: float
    deterministic: bool
    backend: str
    group: object
    rank: int
    world: int


def _narrow(x, dim, rng):
    return x.narrow(dim, rng[0], rng[1] - rng[0])


def _slopes(alibi, call: _Call, spec: _Spec):
    if alibi is None or alibi.dim() == 1 or spec.varlen_layout is None:
        return alibi
    n0, n1 = call.seqs
    return alibi[n0:n1]


def _attend(q, k, v, alibi, call: _Call, spec: _Spec):
    """One single-GPU call; returns (out, lse) of rows ``call.rows`` in the layouts of q and the op."""
    td = spec.tdim
    qc, kc, vc = _narrow(q, td, call.rows), _narrow(k, td, call.keys), _narrow(v, td, call.keys)
    if call.reversed:
        qc, kc, vc = qc.flip(td), kc.flip(td), vc.flip(td)
    causal = call.window == (-1, 0)
    slopes = _slopes(alibi, call, spec)
    kw = dict(softmax_scale=spec.softmax_scale, causal=causal, window_size=(-1, -1) if causal else call.window,
              softcap=spec.softcap, alibi_slopes=slopes, deterministic=spec.deterministic, return_attn_probs=True,
              backend=spec.backend)
    if spec.varlen_layout is None:
        out, lse, _ = flash_api.flash_attn_func(qc, kc, vc, **kw)
    else:
        cu_q, cu_k, max_q, max_k = spec.layout.offsets[_offsets(call)]
        with C.values_checked():            # the plan's offsets, from the checked global ones
            out, lse, _ = flash_api.flash_attn_varlen_func(qc, kc, vc, cu_q, cu_k, max_q, max_k,
                                                           layout=spec.varlen_layout, **kw)
    if call.reversed:
        out, lse = out.flip(td), lse.flip(-1)
        if slopes is not None:      # reversed upper part: the op's distance was one short
            per_row = slopes.reshape(-1, 1) if lse.dim() == 2 else slopes.reshape(-1, slopes.shape[-1], 1)
            lse = lse - per_row.to(lse.dtype)
    return out, lse


def _lse_like_out(lse, spec: _Spec):
    """lse (B, H, L) / (H, L) viewed to broadcast against out (B, L, H, Dv) / (L, H, Dv) / (H, L, Dv)."""
    if spec.varlen_layout == "htd":
        return lse.unsqueeze(-1)
    return lse.transpose(-1, -2).unsqueeze(-1)


def _merge(parts, spec: _Spec):
    """Merge partial (out, lse) over disjoint key sets in fp32 (fp64 for fp64): rows without any key
    (lse = +inf everywhere) get zeros and lse = +inf."""
    outs, lses = zip(*parts)
    dt = accumulation_dtype(outs[0].dtype)
    lse = torch.stack([torch.where(x == float("inf"), torch.full_like(x, float("-inf")), x) for x in lses]).to(dt)
    m = lse.max(0).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)
    total = w.sum(0)
    seen = total > 0
    merged_lse = torch.where(seen, m + torch.log(torch.where(seen, total, torch.ones_like(total))),
                             torch.full_like(total, float("inf")))
    safe = torch.where(seen, total, torch.ones_like(total))
    out = sum(_lse_like_out(w[i] / safe, spec) * o.to(dt) for i, o in enumerate(outs))
    return out.to(outs[0].dtype), merged_lse.to(lses[0].dtype)


def _global_order(stacked, spec: _Spec):
    """(W, ..local..) gathered shards -> the tensor in global token order."""
    parts = [stacked[r].narrow(spec.tdim, start, n) for r, start, n in spec.layout.order]
    return parts[0] if len(parts) == 1 else torch.cat(parts, spec.tdim)


def _run_group(q, kv_stacked, d, alibi, spec: _Spec):
    """Attention of one head group: q (local, this group's query heads), kv_stacked (W, .., D + Dv)."""
    kv = _global_order(kv_stacked, spec)
    k, v = kv.narrow(-1, 0, d), kv.narrow(-1, d, kv.shape[-1] - d)
    outs = []
    for block in spec.layout.blocks:
        parts = [_attend(q, k, v, alibi, call, spec) for call in block]
        # guard (no backend that takes ALiBi trips it today): a merge by an LSE without gradient would give
        # a wrong gradient; checked on every rank (the last one may have no merge of its own)
        if spec.layout.merges and torch.is_grad_enabled() and parts[0][0].requires_grad:
            if not all(lse.requires_grad for _, lse in parts):
                raise ValueError(
                    f"alibi_slopes with keys after the queries (causal=False and window right bound != 0) over "
                    f"{spec.world} ranks merges two partial results by their LSE, and backend={spec.backend!r} "
                    f"does not differentiate its LSE: the gradient would be wrong. Use backend='torch' or "
                    f"'triton', causal=True, or run without gradients")
        outs.append(parts[0] if len(parts) == 1 else _merge(parts, spec))
    out = torch.cat([o for o, _ in outs], spec.tdim) if len(outs) > 1 else outs[0][0]
    lse = torch.cat([x for _, x in outs], -1) if len(outs) > 1 else outs[0][1]
    return out, lse


# ---------------------------------------------------------------------------------------------
# communication: pipelined all-gather forward, reduce-scatter backward
# ---------------------------------------------------------------------------------------------


# single-buffer collectives (torch >= 2.13 names them *_single and deprecates the *_tensor names)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _start_gather(x, spec: _Spec):
    """Post the all-gather of x (this rank's packed K/V of one head group); returns (buffer, work)."""
    x = x.contiguous()
    if spec.world == 1:
        return x.unsqueeze(0), None
    buf = torch.empty((spec.world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    return buf, _ALL_GATHER(buf.flatten(0, 1), x, group=spec.group, async_op=True)   # ranks concatenated on dim 0


def _start_reduce_scatter(grad, spec: _Spec):
    """Post the sum over ranks of grad (W, ...) keeping this rank's slice; returns (result getter, work)."""
    if spec.world == 1:
        return (lambda: grad[0]), None
    grad = grad.contiguous()
    if dist.get_backend(spec.group) == dist.Backend.NCCL:
        out = torch.empty_like(grad[0])
        return (lambda: out), _REDUCE_SCATTER(out, grad.flatten(0, 1), group=spec.group, async_op=True)
    total = grad.clone()            # gloo has no reduce-scatter: all-reduce and keep the own slice
    return (lambda: total[spec.rank]), dist.all_reduce(total, group=spec.group, async_op=True)


def _head_groups(hk: int, world: int) -> List[Tuple[int, int]]:
    n = PIPELINE_GROUPS if world > 1 and hk % PIPELINE_GROUPS == 0 else 1
    return [(i * hk // n, (i + 1) * hk // n) for i in range(n)]


class ContextParallelAttnFunction(torch.autograd.Function):
    """Forward: per head group, gather K/V (the next group's gather in flight) and run the calls under
    autograd; backward: per group in reverse, the calls' backward and the reduce-scatter of dK/dV (the
    previous group's reduce-scatter in flight)."""

    @staticmethod
    def forward(ctx, q, k, v, alibi, spec: _Spec):
        need_grad = any(ctx.needs_input_grad[:3])
        hq, hk = q.shape[spec.hdim], k.shape[spec.hdim]
        groups = _head_groups(hk, spec.world)
        ratio = hq // hk
        d = k.shape[-1]
        pending = _start_gather(torch.cat([k.narrow(spec.hdim, *_len(groups[0])),
                                           v.narrow(spec.hdim, *_len(groups[0]))], -1), spec)
        graphs, outs, lses = [], [], []
        for g, (h0, h1) in enumerate(groups):
            nxt = None
            if g + 1 < len(groups):
                a, b = groups[g + 1]
                nxt = _start_gather(torch.cat([k.narrow(spec.hdim, a, b - a), v.narrow(spec.hdim, a, b - a)], -1),
                                    spec)
            buf, work = pending
            if work is not None:
                work.wait()
            qh = (h0 * ratio, h1 * ratio)
            slopes = None if alibi is None else alibi[..., qh[0]:qh[1]]
            with torch.enable_grad() if need_grad else torch.no_grad():
                qg = _narrow(q, spec.hdim, qh).detach().requires_grad_(need_grad)
                kvg = buf.detach().requires_grad_(need_grad)
                out, lse = _run_group(qg, kvg, d, slopes, spec)
            graphs.append((qg, kvg, out, lse))
            outs.append(out.detach())
            lses.append(lse.detach())
            pending = nxt
        lse_hdim = 0 if spec.varlen_layout is not None else 1
        out = torch.cat(outs, spec.hdim) if len(outs) > 1 else outs[0]
        lse = torch.cat(lses, lse_hdim) if len(lses) > 1 else lses[0]
        ctx.graphs = graphs if need_grad else None
        ctx.spec, ctx.d, ctx.groups, ctx.ratio = spec, d, groups, ratio
        if not all(x.requires_grad for *_, x in graphs):
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        spec, d = ctx.spec, ctx.d
        lse_hdim = 0 if spec.varlen_layout is not None else 1
        need_kv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dqs, pending = [None] * len(ctx.groups), [None] * len(ctx.groups)
        for g in reversed(range(len(ctx.groups))):
            qg, kvg, out, lse = ctx.graphs[g]
            h0, h1 = ctx.groups[g]
            qh = (h0 * ctx.ratio, h1 * ctx.ratio)
            outputs, grads = [], []
            if out.requires_grad:       # not when no local row sees a key (varlen with Sq > Sk)
                outputs.append(out)
                grads.append(_narrow(dout, spec.hdim, qh))
            if lse.requires_grad and dlse is not None:
                outputs.append(lse)
                grads.append(_narrow(dlse, lse_hdim, qh))
            dq = dkv = None
            if outputs:
                dq, dkv = torch.autograd.grad(outputs, (qg, kvg), grads, allow_unused=True)
            dqs[g] = dq if dq is not None else torch.zeros_like(qg)
            if need_kv:
                pending[g] = _start_reduce_scatter(dkv if dkv is not None else torch.zeros_like(kvg), spec)
        ctx.graphs = None
        dq = torch.cat(dqs, spec.hdim) if len(dqs) > 1 else dqs[0]
        dk = dv = None
        if need_kv:
            dkvs = []
            for get, work in pending:
                if work is not None:
                    work.wait()
                dkvs.append(get())
            dkv = torch.cat(dkvs, spec.hdim) if len(dkvs) > 1 else dkvs[0]
            dk, dv = dkv.narrow(-1, 0, d), dkv.narrow(-1, d, dkv.shape[-1] - d)
        return dq, dk, dv, None, None


def _len(rng):
    return rng[0], rng[1] - rng[0]


# ---------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------


def _refuse_dropout(dropout_p) -> None:
    if dropout_p > 0:
        raise ValueError(f"dropout_p must be 0 for context-parallel attention: the single-GPU op draws one "
                         f"dropout mask over the whole score matrix and per-rank calls cannot reproduce it, "
                         f"got {dropout_p}")


def _order(t_local: int, world: int, layout: str) -> Tuple[Tuple[int, int, int], ...]:
    """(source rank, local start, length) of every global chunk, in global order."""
    pieces = []
    for r in range(world):
        start = 0
        for a, b in chunk_ranges(t_local, r, world, layout):
            pieces.append((a, r, start, b - a))
            start += b - a
    return tuple((r, s, n) for _, r, s, n in sorted(pieces))


def _global_lengths(tq: int, tk: int, world: int, layout: str, what_q: str, what_k: str) -> Tuple[int, int]:
    """(W tq, W tk): every rank holds tq queries and tk keys, W tq and W tk divisible by W (contiguous) or 2W
    (zigzag); ValueError naming ``what_q`` / ``what_k`` otherwise."""
    return tuple(local_length(t * world, world, layout, f"{what} (local {t} x world size {world})") * world
                 for t, what in ((tq, what_q), (tk, what_k)))


def _apply(q, k, v, alibi_slopes, p: Plan, window: Tuple[int, int], *, tdim: int, hdim: int,
           varlen_layout: Optional[str], softmax_scale: float, softcap: float, return_lse: bool,
           deterministic: bool, backend: str, group):
    """This rank's planned calls (once per plan and mask options) run under ``ContextParallelAttnFunction``."""
    spec = _Spec(tdim=tdim, hdim=hdim, varlen_layout=varlen_layout, layout=_layout(p, window, alibi_slopes is not None),
                 softmax_scale=softmax_scale, softcap=softcap, deterministic=deterministic, backend=backend,
                 group=group, rank=p.rank, world=p.world)
    out, lse = ContextParallelAttnFunction.apply(q, k, v, alibi_slopes, spec)
    return (out, lse, None) if return_lse else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, group=None,
                    layout=None, backend="auto", plan: Optional[Plan] = None):
    """Context-parallel ``da.flash_attn_func``: q (B, Sq_local, Hq, D) is this rank's shard of the Sq =
    W * Sq_local queries and k, v (B, Sk_local, Hk, D / Dv) its shards of the Sk = W * Sk_local keys (W ranks
    of ``group``, default the world group), all three laid out by ``layout`` ("contiguous": rank r holds
    positions [r S_local, (r + 1) S_local); "zigzag": chunks r and 2W - 1 - r of 2W, which balances causal
    work when Sq == Sk), i.e. ``dd.shard(q)``, ``dd.shard(k)``, ``dd.shard(v)`` with that layout. ``layout``
    defaults to the plan's, else "contiguous".

    Sq may differ from Sk (both layouts): masks and ALiBi are the single-GPU op's, on global positions and
    aligned bottom-right (query i sees key j when i + Sk - Sq - wl <= j <= i + Sk - Sq + wr); rows that see
    no key return zeros and lse = +inf. Sq_local and Sk_local must be >= 1 (even for zigzag). Returns this
    rank's out (B, Sq_local, Hq, Dv), or ``(out, lse (B, Hq, Sq_local), None)`` with ``return_attn_probs``.
    Every option of ``da.flash_attn_func`` but dropout (refused: per-rank masks cannot match the single-GPU
    op's). ALiBi with keys after the diagonal (causal=False, right window bound != 0) may be refused when
    Sq >= Sk + 2 (ValueError on every rank, as in ``flash_attn_varlen_func``): where a query chunk that starts
    before query Sq - Sk - 1 sees keys past the diagonal of its last row. ``plan``: the batch's
    ``dd.prepare(seqlen=Sq, seqlen_k=Sk, layout=...)``: the calls' planning is done once, on its first call
    with a set of mask options (the calls are planned on the host either way; no call reads the device).

    >>> import delta_attn.distributed as dd      # doctest: +SKIP
    >>> o = dd.flash_attn_func(dd.shard(q), dd.shard(k), dd.shard(v), causal=True)   # doctest: +SKIP
    """
    _, world = group_rank_world(group)
    if layout is not None:
        check_layout(layout)
    args = flash_api.validate_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_attn_probs)
    _refuse_dropout(args.dropout_p)
    tq, tk = q.shape[1], k.shape[1]
    C.positive_dim("q local sequence length (q.shape[1])", tq)
    C.positive_dim("k local sequence length (k.shape[1])", tk)

    def build():
        lay = layout or "contiguous"
        sq, sk = _global_lengths(tq, tk, world, lay, "the global query length Sq", "the global key length Sk")
        return prepare(seqlen=sq, seqlen_k=sk, group=group, layout=lay, device=q.device)

    p = resolve(plan, "dd.flash_attn_func", group, build, device=q.device, varlen=False, t_local=tq, tk_local=tk,
                layout=layout)
    return _apply(q, k, v, alibi_slopes, p, args.window, tdim=1, hdim=2, varlen_layout=None,
                  softmax_scale=args.softmax_scale, softcap=args.softcap, return_lse=args.return_lse,
                  deterministic=deterministic, backend=backend, group=group)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, *, group=None,
                           shard_layout=None, layout="thd", backend="auto", plan: Optional[Plan] = None):
    """Context-parallel ``da.flash_attn_varlen_func``: q is this rank's equal share (Tq_local tokens) of the
    packed queries (W * Tq_local tokens), k and v its equal share (Tk_local tokens) of the packed keys
    (W * Tk_local tokens), both split by ``shard_layout`` ("contiguous" or "zigzag", as ``dd.shard``; default
    the plan's, else "contiguous").
    ``cu_seqlens_q`` / ``cu_seqlens_k`` describe the whole packed batch with global offsets; they may differ
    (Sq != Sk per sequence, bottom-right alignment as in the single-GPU op: query i of sequence s sees key
    j when i + Sk_s - Sq_s - wl <= j <= i + Sk_s - Sq_s + wr), and a sequence may span ranks in q and in k.
    ``layout`` is the tensors' layout as in ``da.flash_attn_varlen_func`` ("thd" / "htd"). Returns this
    rank's out, or ``(out, lse (Hq, Tq_local), None)``. Dropout is refused; ALiBi with keys after the
    diagonal (causal=False, right window bound != 0) is refused where a q shard boundary cuts a sequence
    with Sq_s >= Sk_s + 2 (no single-GPU call aligns its distance there). ``plan``: the batch's
    ``dd.prepare(cu_seqlens=..., cu_seqlens_k=..., layout=...)``; with it the call reads nothing on the host
    (without it, the offsets are read once), and ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``,
    ``max_seqlen_k`` may be None (the plan's).
    """
    _, world = group_rank_world(group)
    if shard_layout is not None:
        C.one_of("shard_layout", shard_layout, ("contiguous", "zigzag"))
    C.one_of("layout", layout, flash_api.LAYOUTS)
    doc = "(total, heads, head_dim)" if layout == "thd" else "(heads, total, head_dim)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        C.tensor(name, x, 3, shape_doc=doc)
    tdim, hdim = (0, 1) if layout == "thd" else (1, 0)
    C.dim_equal("local token count", "v", v.shape[tdim], "k", k.shape[tdim])
    C.dim_equal("heads", "v", v.shape[hdim], "k", k.shape[hdim])
    tq, tk = q.shape[tdim], k.shape[tdim]

    def build():
        lay = shard_layout or "contiguous"
        total_q, total_k = _global_lengths(tq, tk, world, lay, "the packed query count", "the packed key count")
        C.cu_seqlens_meta("cu_seqlens_q", cu_seqlens_q, q.device)
        n = C.cu_seqlens_meta("cu_seqlens_k", cu_seqlens_k, q.device) - 1
        values = torch.cat([cu_seqlens_q, cu_seqlens_k]).tolist()      # the one host read of a call without plan
        cu_q, cu_k = values[:cu_seqlens_q.numel()], values[cu_seqlens_q.numel():]
        if len(cu_k) != len(cu_q):
            raise ValueError(f"cu_seqlens_k must describe as many sequences as cu_seqlens_q ({len(cu_q) - 1}), "
                             f"got {n}")
        C.cu_seqlens_values("cu_seqlens_q", cu_q, total_q, max_seqlen_q, "max_seqlen_q")
        C.cu_seqlens_values("cu_seqlens_k", cu_k, total_k, max_seqlen_k, "max_seqlen_k")
        return prepare(seqlen=total_q, seqlen_k=total_k, cu_seqlens=cu_q, cu_seqlens_k=cu_k, group=group,
                       layout=lay, device=q.device)

    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None or plan is None:
            C.max_seqlen(name, m)
    p = resolve(plan, "dd.flash_attn_varlen_func", group, build, device=q.device, varlen=True, t_local=tq,
                tk_local=tk, layout=shard_layout, cu_seqlens=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for name, m, want in (("max_seqlen_q", max_seqlen_q, p.max_seqlen), ("max_seqlen_k", max_seqlen_k, p.max_seqlen_k)):
        if m is not None and m < want:
            raise ValueError(f"{name} must be >= the longest sequence ({want}), got {m}")
    common = flash_api._common(q, k, v, q.shape[hdim], k.shape[hdim], p.num_seqs, dropout_p, softmax_scale, causal,
                               window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    _refuse_dropout(common["dropout_p"])
    return _apply(q, k, v, alibi_slopes, p, common["window"], tdim=tdim, hdim=hdim, varlen_layout=layout,
                  softmax_scale=common["softmax_scale"], softcap=common["softcap"], return_lse=common["return_lse"],
                  deterministic=deterministic, backend=backend, group=group)


__all__ = ["flash_attn_func", "flash_attn_varlen_func", "ContextParallelAttnFunction", "PIPELINE_GROUPS"]
