"""The suites: which cases, implementations and directions each one times.

- ``matrix``: the seeds' config matrix plus H200-sized shapes, every attention implementation,
  fp16 and bf16, forward; latency median / mean / std and query tokens per second.
- ``kernels``: each delta-attn operator against its peers at the bar shapes of docs/PEERS.md,
  fwd / bwd / fwd+bwd.
- ``crossover``: fixed tokens per batch, S from 1K to 128K (linear operators to 1M), causal, fwd and
  fwd+bwd, quadratic and linear side by side.
- ``decode``: one new token over a KV cache (attention) against the KDA and diagonal state updates, and
  ``flash_attn_with_kvcache`` (append + attend, contiguous and paged caches) against SDPA and cuDNN paged.
- ``ceilings``: only the copy bandwidth and GEMM rate (measured at the start of every suite anyway).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from . import impls as I
from .runner import DTYPES, Settings, Task

SUITES = ("crossover", "kernels", "matrix", "decode", "ceilings")

# 16 causal sequences of 256 to 8192 tokens, 66,816 tokens in all (the varlen shape of docs/PEERS.md)
VARLEN_SEQLENS = [256, 512, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5632, 5120, 6656, 6144, 8192, 8192, 8192]


def _selected(impl: I.Impl, s: Settings) -> bool:
    return not s.impls or any(x.lower() in impl.name.lower() for x in s.impls)


def _impls(op: str, s: Settings, exclude: tuple = ()) -> List[I.Impl]:
    dev = torch.device(s.device)
    return [i for i in I.catalogue(op, dev) if _selected(i, s) and not any(x in i.name for x in exclude)]


def _dirs(s: Settings, default) -> tuple:
    return tuple(s.directions) if s.directions else tuple(default)


def _pow2_range(lo: int, hi: int) -> List[int]:
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return out


# ------------------------------------------------------------------------------------------ crossover

def crossover_lengths(s: Settings) -> Dict[str, List[int]]:
    if s.tiny:
        quad = [16, 32]
        lin = quad + [64]
    elif s.quick:
        quad = [x for x in (1024, 4096, 16384, 65536) if x <= s.max_seq]
        lin = quad + [x for x in (262144,) if x <= s.max_linear_seq]
    else:
        quad = _pow2_range(1024, s.max_seq)
        lin = _pow2_range(1024, s.max_linear_seq)
    return {"quadratic": quad, "linear": lin}


def coarse_to_fine(lengths: List[int]) -> List[int]:
    """The lengths in the order that brackets the crossover soonest: both ends first, then the
    midpoint of every interval, level by level (1K, 128K, 8K, 2K, 32K, 4K, 16K, 64K)."""
    xs = sorted(set(lengths))
    if len(xs) <= 2:
        return xs
    out, level = [xs[0], xs[-1]], [(0, len(xs) - 1)]
    while level:
        nxt = []
        for lo, hi in level:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                out.append(xs[mid])
                nxt += [(lo, mid), (mid, hi)]
        level = nxt
    return out


def _slow_to_start(impl: I.Impl) -> bool:
    """Peers whose first call autotunes for minutes on a cold machine (FLA's Triton autotuners):
    they run after every other row has given the crossover its lengths."""
    return impl.provider == "fla-core"


def slow_starters_last(tasks: List[Task]) -> List[Task]:
    """``tasks`` with the slow starters' rows moved after all others, one direction at a time (their
    forward, tuned once, is then timed at every shape before a backward autotuning can use up the
    budget); the order is otherwise kept."""
    fast = [t for t in tasks if not _slow_to_start(t.impl)]
    slow = [t for t in tasks if _slow_to_start(t.impl)]
    directions = list(dict.fromkeys(d for t in slow for d in t.directions))
    return fast + [Task(t.suite, t.case, t.impl, (d,), t.dtype, t.series)
                   for d in directions for t in slow if d in t.directions]


def crossover(s: Settings) -> List[Task]:
    """Ordered so that a crossover is computable as early as possible under any time budget:
    implementations that start fast (ours, cuDNN, FA2) before the ones that autotune for minutes
    (``slow_starters_last``); within those, lengths coarse to fine, the lengths shared with the quadratic operators
    before the linear-only ones; at each length the quadratic rows before the linear ones, so that a
    linear row always has a quadratic row to be compared with."""
    h, d, tokens = s.heads, s.head_dim, s.tokens
    lengths = crossover_lengths(s)
    dirs = _dirs(s, ("fwd", "fwd+bwd"))
    shared = coarse_to_fine(lengths["quadratic"])
    order = shared + coarse_to_fine([x for x in lengths["linear"] if x not in shared])
    tasks = []
    for dname in s.dtypes:
        dt = DTYPES[dname]
        # SDPA's memory-efficient kernel and FLA's token-by-token fused_recurrent_hgrn (4-15x slower than
        # chunk_hgrn) are never the best; delta-attn's sdpa backend runs the same FA2 kernel as the
        # "FA2 (SDPA flash)" row: all three are left to the kernels suite to save time
        excluded = ("mem-efficient", "delta-attn sdpa", "fused_recurrent")
        impls = [(op, family, impl) for op, family in (("flash", "quadratic"), ("kda", "linear"), ("diag", "linear"))
                 for impl in _impls(op, s, exclude=excluded)]
        for S in order:
            for op, family, impl in impls:
                if S not in lengths[family]:
                    continue
                case = {"op": op, "B": max(1, tokens // S), "S": S, "H": h, "Hk": h, "D": d, "causal": True}
                if op != "flash":
                    case.pop("Hk"), case.pop("causal")
                tasks.append(Task("crossover", case, impl, dirs, dt, series="crossover"))
    return slow_starters_last(tasks)


# ------------------------------------------------------------------------------------------ kernels

def kernel_cases(s: Settings) -> Dict[str, List[Dict]]:
    if s.tiny:
        return {
            "flash": [dict(B=2, S=32, H=2, Hk=2, D=16, causal=True), dict(B=2, S=32, H=4, Hk=2, D=16, causal=False)],
            "flash_varlen": [dict(seqlens=[5, 17, 10], H=2, D=16, causal=True)],
            "kda": [dict(B=1, S=32, H=2, D=16)],
            "diag": [dict(B=1, S=32, H=2, D=16)],
            "kda_decode": [dict(B=2, H=2, D=16)],
            "diag_decode": [dict(B=2, H=2, D=16)],
            "flash_decode": [dict(B=2, ctx=32, H=2, Hk=2, D=16)],
        }
    flash = [(128, 4096, True), (128, 16384, False)] if s.quick else [
        (128, 1024, False), (128, 4096, False), (128, 4096, True), (128, 16384, False), (128, 16384, True),
        (128, 32768, True), (64, 4096, False), (64, 16384, True)]
    kda = ([(8, 4096), (1, 32768)] if s.quick
           else [(8, 4096), (64, 1024), (16, 2048), (2, 16384), (1, 32768), (1, 131072)])
    diag = [(8, 4096)] if s.quick else [(8, 4096), (1, 32768)]
    # KDA first; the slow starters (FLA) run last (slow_starters_last); the report orders the tables by operator
    return {
        "kda": [dict(B=b, S=t, H=16, D=128, decays=r) for b, t in kda for r in ("long", "strong")],
        "kda_decode": [dict(B=64, H=16, D=128)],
        "flash": [dict(B=32768 // S, S=S, H=2048 // D, Hk=2048 // D, D=D, causal=c) for D, S, c in flash],
        "flash_varlen": [dict(seqlens=list(VARLEN_SEQLENS), H=16, D=128, causal=True)],
        "diag": [dict(B=b, S=t, H=16, D=128) for b, t in diag],
        "diag_decode": [dict(B=64, H=16, D=128)],
        "flash_decode": [dict(B=64, ctx=8192, H=16, Hk=16, D=128)],
    }


def kernels(s: Settings) -> List[Task]:
    tasks = []
    for dname in s.dtypes:
        dt = DTYPES[dname]
        for op, cs in kernel_cases(s).items():
            if s.ops and op not in s.ops:
                continue
            dirs = ("fwd",) if op.endswith("decode") else _dirs(s, ("fwd", "bwd", "fwd+bwd"))
            for c in cs:
                c = dict(c, op=op)
                if op == "flash_varlen":
                    c["max_seqlen"] = max(c["seqlens"])
                for impl in _impls(op, s):
                    tasks.append(Task("kernels", c, impl, dirs, dt, series=f"kernels:{op}:{c.get('D')}"))
    return slow_starters_last(tasks)


# ------------------------------------------------------------------------------------------ matrix

MATRIX_SEED = [(1, 1, 128, 64), (8, 4, 128, 64), (32, 8, 128, 64), (32, 8, 256, 64)]
MATRIX_H200 = [(16, 16, 2048, 128), (4, 16, 8192, 128), (1, 16, 32768, 128), (8, 32, 4096, 64), (1, 32, 32768, 64)]


def matrix(s: Settings) -> List[Task]:
    if s.tiny:
        shapes = [(1, 1, 16, 16), (2, 2, 32, 16)]
    elif s.quick:
        shapes = MATRIX_SEED + [MATRIX_H200[1], MATRIX_H200[3]]
    else:
        shapes = MATRIX_SEED + MATRIX_H200
    dtypes = s.dtypes
    tasks = []
    for dname in dtypes:
        dt = DTYPES[dname]
        for b, h, S, d in shapes:
            c = dict(op="flash", B=b, S=S, H=h, Hk=h, D=d, causal=False)
            for impl in _impls("flash", s):
                tasks.append(Task("matrix", c, impl, _dirs(s, ("fwd",)), dt, series=f"matrix:{dname}"))
    return tasks


# ------------------------------------------------------------------------------------------ decode

def decode_grid(s: Settings):
    if s.tiny:
        return [32, 128], [1, 4]
    if s.quick:
        return [4096, 65536, 1048576], [1, 64]
    return [4096, 16384, 65536, 262144, 1048576], [1, 16, 64, 256]


def kvcache_cases(s: Settings) -> List[Dict]:
    """``flash_attn_with_kvcache`` steps at the issue's shape: B = 64, cache 8K, Hq = 32, Hk = 8, D = 128,
    one new token, contiguous and paged (256-token pages, flash-attn 2's page granularity)."""
    if s.tiny:
        return [dict(B=2, ctx=32, H=4, Hk=2, D=16, page=page) for page in (0, 8)]
    return [dict(B=64, ctx=8192, H=32, Hk=8, D=128, page=page) for page in (0, 256)]


def decode(s: Settings, kv_budget_bytes: float) -> List[Task]:
    ctxs, batches = decode_grid(s)
    h, d = (2, 16) if s.tiny else (s.heads, s.head_dim)
    tasks = []
    for dname in s.dtypes:
        for c in kvcache_cases(s):
            for impl in _impls("kvcache_decode", s):
                tasks.append(Task("decode", dict(c, op="kvcache_decode"), impl, ("fwd",), DTYPES[dname],
                                  series=f"decode:kvcache:{c['page']}"))
    for dname in s.dtypes:
        dt = DTYPES[dname]
        elt = torch.empty(0, dtype=dt).element_size()
        for b in batches:
            for ctx in ctxs:
                c = dict(op="flash_decode", B=b, ctx=ctx, H=h, Hk=h, D=d)
                kv = 2 * b * ctx * h * d * elt
                for impl in _impls("flash_decode", s):
                    t = Task("decode", c, impl, ("fwd",), dt, series=f"decode:{b}")
                    if kv > kv_budget_bytes:
                        t.case = dict(c, over_budget=kv)
                    tasks.append(t)
            for op in ("kda_decode", "diag_decode"):
                for impl in _impls(op, s):
                    tasks.append(Task("decode", dict(op=op, B=b, H=h, D=d), impl, ("fwd",), dt))
    return tasks


def build(suite: str, s: Settings, kv_budget_bytes: float = 40e9) -> List[Task]:
    if suite == "crossover":
        return crossover(s)
    if suite == "kernels":
        return kernels(s)
    if suite == "matrix":
        return matrix(s)
    if suite == "decode":
        return decode(s, kv_budget_bytes)
    if suite == "ceilings":
        return []
    raise ValueError(f"unknown suite {suite!r}; one of {', '.join(SUITES)}")
