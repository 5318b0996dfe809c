"""Experiment (issue #18, item 4): a persistent, software-pipelined KDA decode step, against the shipped
``_kda_step_kernel`` and a ``copy_`` of the same state bytes.

The shipped kernel runs one program per (V block, sequence, value head): load the fp32 state block, walk the
tokens, store; within a program the phases do not overlap and the last wave is ragged. Here a persistent grid
(``per_sm`` programs per SM, or ``"occ"``: as many as the compiled kernel's registers / shared memory let reside)
walks the work items ``w = pid, pid + P, ...`` (item w = (sequence, value head, V block), V block fastest, so the
programs of one round cover a contiguous stretch of the pool) in one of three ways (``PIPE``):

* 0, ``"none"``: load, step, store, item after item (persistence alone);
* 1, ``"manual"``: the next item's start slot and state block are loaded (into registers) before the current
  item is stepped and stored, so that load overlaps this item's token loads, arithmetic and store;
* 2, ``"auto"``: Triton's software pipeliner over the item loop (``tl.range(..., num_stages=STAGES)``); the
  pipeliner only handles innermost loops, so the token loop is unrolled (``T`` is a constexpr here).

Per item the arithmetic is the shipped kernel's (``ops/kda/decode.py``): decay, both reductions over K from the
decayed state, correction and read-out, delta-rule write; all gate modes, L2NORM, IDX 0/1/2 (speculative (B, T)
slots with ``num_accepted_tokens``), EVEN masks, any K <= 256 and V. Differences: ``T`` is a constexpr (one
compile per token count) and a non-contiguous pool is a ValueError (the experiment steps contiguous pools only).

GPU: ``PYTHONPATH=src python benchmarks/kda_step_persistent.py`` (from the repo root): semantic checks of every
pipeline mode against ``da.kda_step`` on small odd cases, then for B in 64, 256, 1024 (H=16, K=V=128, bf16
inputs, fp32 state, one token, use_qk_l2norm) the copy, the shipped kernel and each variant (output and state
checked against ``da.kda_step`` first), timed as CUDA-graph replays with the L2 flushed (bench.timer.measure).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from delta_attn._outputs import empty
from delta_attn.ops._launch import index, launch, optional, param, sm_count, tiles
from delta_attn.ops._slots import _start_slot
from delta_attn.ops.diag.kernels import _st
from delta_attn.ops.kda.decode import _kda_step_token
from delta_attn.ops.kda.pipeline import _gate_args, _pow2, step_tiles

PIPES = {"none": 0, "manual": 1, "auto": 2}


# ------------------------------------------------------------------------------------------------ kernel

@triton.jit
def _item_of(w, HV, NV: tl.constexpr):
    """Work item w -> (V block, sequence (int64), value head (int64)); V block fastest."""
    iv = w % NV
    r = tl.cast(w // NV, tl.int64)
    return iv, r // HV, r % HV


@triton.jit
def _load_item(S, idx, nat, w, n_items, T, HV, kk, mk,
               K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
               IDX: tl.constexpr, HAS_NAT: tl.constexpr, EVEN: tl.constexpr):
    """The start slot (int64) and fp32 state block (KP x BV) of item w; nothing is read for w >= n_items
    (the prefetch past a program's last item: the address is clamped to a valid item, the load masked off)."""
    valid = w < n_items
    iv, bi, hv = _item_of(tl.minimum(w, n_items - 1), HV, NV)
    slot = _start_slot(idx, nat, bi, T, IDX, HAS_NAT)
    vv = iv * BV + tl.arange(0, BV)
    ptr = S + slot * (HV * K * V) + (hv * K + kk[:, None]) * V + vv[None, :]
    if EVEN:
        st = tl.load(ptr, mask=valid, other=0.0)
    else:
        st = tl.load(ptr, mask=(mk[:, None] & (vv < V)[None, :]) & valid, other=0.0)
    return slot, st.to(tl.float32)


@triton.jit
def _step_item(q, k, v, g, beta, A_log, dt_bias, S, idx, O, st, slot, w, scale, lower_bound, H, HV, kk, mk,
               T: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
               L2NORM: tl.constexpr, GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, IDX: tl.constexpr,
               EVEN: tl.constexpr):
    """The T tokens of item w from its state block ``st`` (fp32, loaded from ``slot``), by the shipped kernel's
    token step; stores o and the state (after each token with (B, T) slots, else once to ``slot``)."""
    iv, bi, hv = _item_of(w, HV, NV)
    h = hv // (HV // H)
    vv = iv * BV + tl.arange(0, BV)
    mv = vv < V
    ms = mk[:, None] & mv[None, :]
    in_slot = (hv * K + kk[:, None]) * V + vv[None, :]
    slot_size = HV * K * V
    a = 1.0
    if GATE != 0:
        a = tl.exp(tl.load(A_log + hv).to(tl.float32))
    bias = tl.zeros(kk.shape, tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + hv * K + kk, mask=mk, other=0.0).to(tl.float32)
    for t in tl.static_range(T):
        st = _kda_step_token(q, k, v, g, beta, S, idx, O, st, a, bias, bi, hv, h, t, kk, mk, vv, mv, ms, in_slot,
                             scale, lower_bound, T, H, HV, K, V, L2NORM, GATE, IDX, EVEN)
    if IDX != 2:
        _st(S + slot * slot_size + in_slot, st.to(S.dtype.element_ty), ms, EVEN)


@triton.jit
def _kda_step_persistent_kernel(q, k, v, g, beta, A_log, dt_bias, S, idx, nat, O,
                                scale, lower_bound, n_items, H, HV,
                                T: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                                BV: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr,
                                HAS_DT_BIAS: tl.constexpr, IDX: tl.constexpr, HAS_NAT: tl.constexpr,
                                EVEN: tl.constexpr, PIPE: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    NV: tl.constexpr = (V + BV - 1) // BV
    kk = tl.arange(0, KP)
    mk = kk < K
    if PIPE == 1:
        # manual prefetch: item w + nprog's slot and state are in flight while item w is stepped and stored
        slot_n, st_n = _load_item(S, idx, nat, pid, n_items, T, HV, kk, mk, K, V, BV, NV, IDX, HAS_NAT, EVEN)
        for w in range(pid, n_items, nprog):
            slot, st = slot_n, st_n
            slot_n, st_n = _load_item(S, idx, nat, w + nprog, n_items, T, HV, kk, mk, K, V, BV, NV, IDX,
                                      HAS_NAT, EVEN)
            _step_item(q, k, v, g, beta, A_log, dt_bias, S, idx, O, st, slot, w, scale, lower_bound, H, HV, kk,
                       mk, T, K, V, BV, NV, L2NORM, GATE, HAS_DT_BIAS, IDX, EVEN)
    elif PIPE == 2:
        # Triton's pipeliner over the item loop (loads of later items issued STAGES - 1 iterations ahead)
        for w in tl.range(pid, n_items, nprog, num_stages=STAGES):
            slot, st = _load_item(S, idx, nat, w, n_items, T, HV, kk, mk, K, V, BV, NV, IDX, HAS_NAT, EVEN)
            _step_item(q, k, v, g, beta, A_log, dt_bias, S, idx, O, st, slot, w, scale, lower_bound, H, HV, kk,
                       mk, T, K, V, BV, NV, L2NORM, GATE, HAS_DT_BIAS, IDX, EVEN)
    else:
        for w in range(pid, n_items, nprog):
            slot, st = _load_item(S, idx, nat, w, n_items, T, HV, kk, mk, K, V, BV, NV, IDX, HAS_NAT, EVEN)
            _step_item(q, k, v, g, beta, A_log, dt_bias, S, idx, O, st, slot, w, scale, lower_bound, H, HV, kk,
                       mk, T, K, V, BV, NV, L2NORM, GATE, HAS_DT_BIAS, IDX, EVEN)


# ------------------------------------------------------------------------------------------------ launcher

@dataclass(frozen=True)
class Variant:
    """One launch of the persistent step: programs per SM (an int, or ``"occ"``: the resident count the
    compiled kernel allows), the item loop's pipelining (``PIPES``), its stages (``"auto"`` only), BV (None:
    the shipped ``step_tiles`` BV) and warps."""
    per_sm: Union[int, str] = 2
    pipe: str = "manual"
    stages: int = 1
    BV: Optional[int] = None
    warps: int = 4

    def __str__(self):
        return f"per_sm={self.per_sm} pipe={self.pipe} stages={self.stages} BV={self.BV} warps={self.warps}"


_OCC: dict = {}


def _resident(kernel, args, fixed, t, device) -> int:
    """Programs of the compiled kernel that fit on one SM (registers, shared memory, warps): the ``"occ"`` grid."""
    key = (tuple(sorted(fixed.items())), t, str(args[7].dtype), str(args[0].dtype))
    if key not in _OCC:
        c = kernel.warmup(*args, grid=(1,), **fixed, **dict(t.meta), num_warps=t.num_warps,
                          num_stages=t.num_stages)
        c._init_handles()
        props = torch.cuda.get_device_properties(device)
        regs_per_warp = -(-max(c.n_regs, 1) * 32 // 256) * 256
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * t.num_warps)
        by_warps = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * t.num_warps)
        smem = int(c.metadata.shared)
        by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // smem if smem else 32
        _OCC[key] = max(1, min(by_regs, by_warps, by_smem, 32))
        print(json.dumps(dict(compiled=dict(t.meta), warps=t.num_warps, n_regs=c.n_regs, n_spills=c.n_spills,
                              shared=smem, resident_per_sm=_OCC[key])), flush=True)
    return _OCC[key]


def persistent_step(q, k, v, g, beta, state, state_indices, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
                    num_accepted_tokens=None, variant: Variant = Variant()):
    """``kda/pipeline.decode_step``'s contract (validated inputs, ``state`` updated in place, o returned) with
    the persistent kernel; a non-contiguous ``state`` is a ValueError."""
    if not state.is_contiguous():
        raise ValueError(f"state must be contiguous for the persistent step experiment (got strides "
                         f"{tuple(state.stride())})")
    if variant.pipe not in PIPES:
        raise ValueError(f"variant.pipe must be one of {sorted(PIPES)} (got {variant.pipe!r})")
    q, k, v, g, beta, A_log, dt_bias = map(param, (q, k, v, g, beta, A_log, dt_bias))
    state_indices, num_accepted_tokens = index(state_indices), index(num_accepted_tokens)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = empty((B, T, HV, V), v.dtype, q.device)
    if B == 0:
        return o
    KP = _pow2(K)
    BV = variant.BV or step_tiles(K, V).get("BV")
    n_items = B * HV * triton.cdiv(V, BV)
    gate_ptrs, gate_kw = _gate_args(A_log, dt_bias, lower_bound, q)
    args = (q, k, v, g, beta) + gate_ptrs + (state, optional(state_indices, q), optional(num_accepted_tokens, q),
                                             o, float(scale), float(lower_bound or 0.0), n_items, H, HV)
    fixed = dict(T=T, K=K, V=V, KP=KP, L2NORM=use_qk_l2norm, IDX=0 if state_indices is None else state_indices.dim(),
                 HAS_NAT=num_accepted_tokens is not None, EVEN=KP == K and V % BV == 0, PIPE=PIPES[variant.pipe],
                 STAGES=variant.stages, **gate_kw)
    t = tiles("persistent step experiment", num_warps=variant.warps,
              num_stages=variant.stages if variant.pipe == "auto" else 1, BV=BV)
    per_sm = variant.per_sm
    if per_sm == "occ":
        per_sm = _resident(_kda_step_persistent_kernel, args, fixed, t, q.device) if q.is_cuda else 1
    programs = max(1, min(n_items, int(per_sm) * sm_count(q.device)))
    launch(_kda_step_persistent_kernel, lambda _: (programs,), args, fixed, [t])
    return o


# ------------------------------------------------------------------------------------------------ GPU script

VARIANTS = [Variant(per_sm=p, pipe="manual") for p in (1, 2, 3, 4, "occ")] + [
    Variant(per_sm=2, pipe="manual", BV=32, warps=2), Variant(per_sm=4, pipe="manual", BV=32, warps=2),
    Variant(per_sm="occ", pipe="manual", BV=32, warps=2), Variant(per_sm="occ", pipe="manual", BV=32, warps=4),
    Variant(per_sm="occ", pipe="manual", BV=64, warps=8),
    Variant(per_sm="occ", pipe="none"), Variant(per_sm=4, pipe="none", BV=32, warps=2),
    Variant(per_sm=1, pipe="auto", stages=2), Variant(per_sm=1, pipe="auto", stages=3),
    Variant(per_sm="occ", pipe="auto", stages=2), Variant(per_sm="occ", pipe="auto", stages=3, BV=32, warps=2),
    Variant(per_sm=2, pipe="auto", stages=2, BV=32, warps=4),
]
BUDGET_S = 60.0


def _graph_ms(fn, dev):
    """Median of CUDA-graph replays of fn, L2 flushed before each (gpujobs/steps_vs_copy.py's protocol)."""
    from delta_attn.bench.timer import measure_graph
    return measure_graph(fn, dev, warm_calls=3, rep_ms=200, max_reps=400).median_ms


def _inputs(B, T, H, HV, K, V, dev, dtype, P=None, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)      # noqa: E731
    q, k = rnd(B, T, H, K).to(dtype), rnd(B, T, H, K).to(dtype)
    v = rnd(B, T, HV, V).to(dtype)
    g = torch.nn.functional.logsigmoid(rnd(B, T, HV, K)).to(dtype)
    beta = torch.rand(B, T, HV, device=dev, generator=gen).to(dtype)
    state = rnd(P or B, HV, K, V) * 0.1
    return [q, k, v, g, beta], state


def _diff(variant, xs, state, **kw):
    """(max |o - o_shipped|, max |state - state_shipped|) of one step from the same pool."""
    import delta_attn as da
    s_ref, s_var = state.clone(), state.clone()
    o_ref = da.kda_step(*xs, s_ref, backend="triton", **kw)
    K = xs[0].shape[-1]
    scale = kw.get("scale") or K ** -0.5
    o_var = persistent_step(*xs, s_var, kw.get("state_indices"), kw.get("A_log"), kw.get("dt_bias"), scale,
                            kw.get("lower_bound"), kw.get("use_qk_l2norm", False), kw.get("num_accepted_tokens"),
                            variant)
    torch.cuda.synchronize()
    return (o_var.float() - o_ref.float()).abs().max().item(), (s_var - s_ref).abs().max().item(), \
        _same(o_var, o_ref, 2.0 ** -7) and _same(s_var, s_ref, 1e-5)


def _same(x, ref, rel):
    """Within ``rel`` of the largest |ref| (one bf16 rounding for o, a few fp32 roundings for the state)."""
    return bool((x.float() - ref.float()).abs().max() <= rel * max(1.0, ref.float().abs().max().item()))


def _semantic_checks(dev):
    """Every pipeline mode on small odd cases (gate modes, IDX 0/1/2 with num_accepted_tokens, T > 1, uneven
    K and V) against the shipped kernel."""
    B, T, H, HV, K, V = 5, 3, 2, 4, 48, 80
    P = B * T + 3
    gen = torch.Generator(device=dev).manual_seed(7)
    table = torch.randperm(P, device=dev, generator=gen)[:B * T].view(B, T).to(torch.int32)
    nat = torch.randint(1, T + 1, (B,), device=dev, generator=gen, dtype=torch.int32)
    A_log = torch.randn(HV, device=dev, generator=gen) * 0.3
    dt_bias = torch.randn(HV * K, device=dev, generator=gen) * 0.3
    cases = {
        "IDX0 raw gate": dict(),
        "IDX1 softplus gate": dict(state_indices=table[:, 0], A_log=A_log, dt_bias=dt_bias),
        "IDX2 lower_bound gate + nat": dict(state_indices=table, num_accepted_tokens=nat, A_log=A_log,
                                            lower_bound=-5.0),
        "IDX2 softplus, no nat": dict(state_indices=table, A_log=A_log),
    }
    for pipe, stages, bv in (("none", 1, None), ("manual", 1, None), ("manual", 1, 32), ("auto", 2, None),
                             ("auto", 3, 32)):
        variant = Variant(per_sm=1, pipe=pipe, stages=stages, BV=bv)
        for name, kw in cases.items():
            xs, state = _inputs(B, T, H, HV, K, V, dev, torch.bfloat16, P=P, seed=3)
            if "lower_bound" not in kw and "A_log" not in kw:
                xs[3] = xs[3].float().clamp(min=-5).to(xs[3].dtype)
            try:
                do, ds, same = _diff(variant, xs, state, use_qk_l2norm=True, **kw)
                print(json.dumps(dict(check=name, variant=str(variant), o_maxdiff=do, state_maxdiff=ds,
                                      ok=same)), flush=True)
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(check=name, variant=str(variant), error=repr(e)[:300])), flush=True)


def main(batches):
    import delta_attn as da
    from delta_attn.bench.timer import measure
    dev = torch.device("cuda")
    H, D = 16, 128
    print(json.dumps(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
                          sms=sm_count(dev))), flush=True)
    _semantic_checks(dev)

    big = torch.empty(2 ** 30 // 4, device=dev)
    big2 = torch.empty_like(big)
    ceil_ms = measure(lambda: big2.copy_(big), dev).median_ms
    ceiling = 2 * big.numel() * 4 / ceil_ms / 1e9
    del big, big2

    # compile + check every variant on every batch (outside the timing budget)
    cases, ok = {}, {}
    for B in batches:
        xs, state = _inputs(B, 1, H, H, D, D, dev, torch.bfloat16)
        cases[B] = (xs, state)
        for var in VARIANTS:
            try:
                do, ds, ok[(B, var)] = _diff(var, xs, state, use_qk_l2norm=True)
                print(json.dumps(dict(B=B, variant=str(var), o_maxdiff=do, state_maxdiff=ds, ok=ok[(B, var)])),
                      flush=True)
            except Exception as e:  # noqa: BLE001
                ok[(B, var)] = False
                print(json.dumps(dict(B=B, variant=str(var), error=repr(e)[:300])), flush=True)

    rows, t0 = [], time.monotonic()
    for B in batches:
        xs, state = cases[B]
        nbytes = 2 * state.numel() * 4
        other = torch.empty_like(state)
        runs = [("copy_", lambda: other.copy_(state)),
                ("shipped", lambda: da.kda_step(*xs, state, use_qk_l2norm=True, backend="triton"))]
        runs += [(str(var), lambda var=var: persistent_step(*xs, state, None, None, None, D ** -0.5, None, True,
                                                            None, var))
                 for var in VARIANTS if ok[(B, var)]]
        for name, fn in runs:
            if time.monotonic() - t0 > BUDGET_S:
                print(json.dumps(dict(B=B, variant=name, skipped=f"over the {BUDGET_S:.0f} s budget")), flush=True)
                continue
            try:
                ms = _graph_ms(fn, dev)
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(B=B, variant=name, error=repr(e)[:300])), flush=True)
                continue
            r = dict(B=B, variant=name, us=ms * 1e3, state_MB=nbytes / 2 / 1e6, TBps=nbytes / ms / 1e9,
                     of_ceiling=nbytes / ms / 1e9 / ceiling)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"copy ceiling (1 GiB copy_, read+write): {ceiling:.3f} TB/s; timing took {time.monotonic() - t0:.1f} s")
    print(f"{'B':>5s} {'variant':58s} {'us':>8s} {'TB/s':>6s} {'of ceil':>7s}")
    for r in rows:
        print(f"{r['B']:5d} {r['variant'][:58]:58s} {r['us']:8.2f} {r['TBps']:6.3f} {r['of_ceiling']:7.3f}")


if __name__ == "__main__":
    main([int(x) for x in (sys.argv[1:] or ["64", "256", "1024"])])
