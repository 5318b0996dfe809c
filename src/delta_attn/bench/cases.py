"""Benchmark cases: shapes, seeded inputs in delta-attn's layouts, probe shapes for the gate, and
the reference computation (``spec``) each output is checked against.

A case is a plain dict: ``op`` plus its sizes (``B``, ``S``, ``H``, ``Hk``, ``D``, ``causal`` for
attention; ``B``, ``S``, ``H``, ``D`` for the linear ops; ``ctx`` for decode; ``seqlens`` for a
packed batch; ``page`` for ``kvcache_decode``: 0 for a contiguous cache, else the page size of a paged
one).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from delta_attn import reference

# inputs that get gradients (training ops) and inputs the reference is a function of
GRAD_INPUTS = {"flash": ("q", "k", "v"), "flash_varlen": ("q", "k", "v"), "kda": ("q", "k", "v", "g", "beta"),
               "diag": ("q", "k", "v", "g")}
SPEC_INPUTS = {"flash": ("q", "k", "v"), "flash_varlen": ("q", "k", "v"), "flash_decode": ("q", "k", "v"),
               "kvcache_decode": ("q", "k_cache", "v_cache", "k", "v"),
               "kda": ("q", "k", "v", "g", "beta"), "kda_decode": ("q", "k", "v", "g", "beta"),
               "diag": ("q", "k", "v", "g"), "diag_decode": ("q", "k", "v", "g")}
LINEAR_OPS = ("kda", "diag", "kda_decode", "diag_decode")


def label(case: Dict) -> str:
    op = case["op"]
    if op == "flash_varlen":
        lens = case["seqlens"]
        return (f"{len(lens)} seqs {min(lens)}-{max(lens)} ({sum(lens)} tok) H={case['H']} D={case['D']}"
                + (" causal" if case.get("causal", True) else ""))
    if op in ("flash_decode", "kvcache_decode"):
        kv = f"/{case['Hk']}" if case["Hk"] != case["H"] else ""
        page = f" paged {case['page']}" if case.get("page") else ""
        return f"B={case['B']} ctx={case['ctx']} H={case['H']}{kv} D={case['D']}{page}"
    if op in ("kda_decode", "diag_decode"):
        return f"B={case['B']} H={case['H']} D={case['D']}"
    s = f"B={case['B']} S={case['S']} H={case['H']}"
    if op == "flash":
        if case.get("Hk", case["H"]) != case["H"]:
            s += f"/{case['Hk']}"
        return s + f" D={case['D']}" + (" causal" if case.get("causal", True) else "")
    # the default (long-memory) decays are unlabelled; strong ones are a case of their own
    return s + f" D={case['D']}" + (" strong decays" if case.get("decays") == "strong" else "")


def tokens(case: Dict) -> int:
    """Tokens processed by one call (query tokens for attention; new tokens for decode)."""
    op = case["op"]
    if op == "flash_varlen":
        return sum(case["seqlens"])
    if op in ("flash_decode", "kvcache_decode", "kda_decode", "diag_decode"):
        return case["B"]
    return case["B"] * case["S"]


def _seq(x: torch.Tensor) -> torch.Tensor:
    return x


def make_inputs(case: Dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Seeded inputs for ``case`` (generated on the device: the same numbers for every implementation)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    op = case["op"]

    def randn(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dt)

    def decay(*shape, dt):
        # log decays around -0.02 (a long memory), as a trained gate produces; with case["decays"] == "strong",
        # logsigmoid(N(0, 1)) (about -0.8 per token), where a peer's speed depends on the decays
        shift = 0.0 if case.get("decays") == "strong" else 4.0
        return F.logsigmoid(torch.randn(*shape, generator=gen, device=device) + shift).to(dt)

    if op in ("flash", "flash_decode"):
        b, h, hk, d = case["B"], case["H"], case.get("Hk", case["H"]), case["D"]
        sq, sk = (1, case["ctx"]) if op == "flash_decode" else (case["S"], case["S"])
        return {"q": randn(b, sq, h, d), "k": randn(b, sk, hk, d), "v": randn(b, sk, hk, d)}
    if op == "kvcache_decode":
        return kvcache_inputs(case, randn, device, gen)
    if op == "flash_varlen":
        lens = case["seqlens"]
        total, h, d = sum(lens), case["H"], case["D"]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
        return {"q": randn(total, h, d), "k": randn(total, h, d), "v": randn(total, h, d), "cu_seqlens": cu}
    if op in ("kda", "kda_decode"):
        b, h, d = case["B"], case["H"], case["D"]
        t = 1 if op == "kda_decode" else case["S"]
        out = {"q": randn(b, t, h, d), "k": randn(b, t, h, d), "v": randn(b, t, h, d),
               "g": decay(b, t, h, d, dt=dtype),         # every input in the run's dtype, as docs/PEERS.md
               "beta": torch.sigmoid(randn(b, t, h, dt=torch.float32)).to(dtype)}
        if op == "kda_decode":
            out["state"] = randn(b, h, d, d, dt=torch.float32, scale=0.1)
        return out
    if op in ("diag", "diag_decode"):
        b, h, d = case["B"], case["H"], case["D"]
        t = 1 if op == "diag_decode" else case["S"]
        out = {"q": randn(b, t, h, d), "k": randn(b, t, h, d), "v": randn(b, t, h, d), "g": decay(b, t, h, d, dt=dtype)}
        if op == "diag_decode":
            out["state"] = randn(b, h, d, dt=torch.float32)
        return out
    raise ValueError(f"unknown op {op!r}")


def kvcache_inputs(case: Dict, randn, device, gen) -> Dict[str, torch.Tensor]:
    """One decode step over a full cache: ``ctx - 1`` tokens cached, one new token appended (so the step
    reads the whole cache); a paged cache holds exactly the pages the batch uses, in a random order."""
    b, h, hk, d, ctx, page = case["B"], case["H"], case["Hk"], case["D"], case["ctx"], case.get("page", 0)
    out = {"q": randn(b, 1, h, d), "k": randn(b, 1, hk, d), "v": randn(b, 1, hk, d),
           "cache_seqlens": torch.full((b,), ctx - 1, dtype=torch.int32, device=device)}
    if page:
        per_seq = -(-ctx // page)
        out["k_cache"], out["v_cache"] = randn(b * per_seq, page, hk, d), randn(b * per_seq, page, hk, d)
        perm = torch.randperm(b * per_seq, generator=gen, device=device)
        out["block_table"] = perm.view(b, per_seq).to(torch.int32)
    else:
        out["k_cache"], out["v_cache"] = randn(b, ctx, hk, d), randn(b, ctx, hk, d)
    return out


def probe_case(case: Dict, tiny: bool = False, cap: Optional[int] = None) -> Dict:
    """The small shape the correctness gate runs (same dtype, head dims, options, GQA ratio).

    ``tiny``: smaller still, for asking the backend registry which backends can run the call."""
    c = dict(case)
    op = case["op"]
    n = 8 if tiny else cap
    if op in ("flash", "flash_decode", "kvcache_decode"):
        ratio = case["H"] // case.get("Hk", case["H"])
        # two KV heads, so that a kernel which ignores the GQA mapping cannot pass by broadcasting
        c["H"], c["Hk"] = (2 * ratio, 2) if ratio > 1 else (min(case["H"], 2), min(case["H"], 2))
        c["B"] = min(case["B"], 2)
        if op == "flash":
            c["S"] = min(case["S"], n or 256)
        else:
            c["ctx"] = min(case["ctx"], n or 256)
        if case.get("page"):     # several pages per sequence, so that the block-table walk is exercised
            c["page"] = min(case["page"], max(1, c["ctx"] // 4))
    elif op == "flash_varlen":
        lens = [min(x, n or 96) for x in case["seqlens"][:2]] + [min(17, max(case["seqlens"]))]
        c["seqlens"], c["max_seqlen"], c["H"] = lens, max(lens), min(case["H"], 2)
    elif op in ("kda", "diag"):
        # the case's own head count: peers autotune per head count (FLA's keys hold H), so a probe
        # with fewer heads would make them tune twice (measured: ~200 s more for FLA chunk_kda)
        c["B"] = 1
        if tiny:
            c["H"] = min(case["H"], 2)
        c["S"] = min(case["S"], n or (128 if op == "kda" else 256))
    else:
        c["B"], c["H"] = min(case["B"], 2), min(case["H"], 2)
    return c


def spec(op: str, case: Dict, t: Dict[str, torch.Tensor]) -> Callable[[List[torch.Tensor], bool], torch.Tensor]:
    """The reference computation as a function of the ``SPEC_INPUTS`` of ``op`` (cast by the gate).

    State-pool inputs of decode are captured now (before the kernel updates them in place)."""
    causal = case.get("causal", True)
    if op in ("flash", "flash_decode"):
        return lambda L, up: reference.attention(*L, causal=causal, upcast=up)[0]
    if op == "flash_varlen":
        cu = t["cu_seqlens"]
        return lambda L, up: reference.attention_varlen(*L, cu, cu, causal=causal, upcast=up)[0]
    if op == "kvcache_decode":
        lens, table = t["cache_seqlens"], t.get("block_table")
        return lambda L, up: reference.attention_with_kvcache(
            L[0], L[1].detach().clone(), L[2].detach().clone(), *L[3:], cache_seqlens=lens, block_table=table,
            causal=True, upcast=up)[0]
    if op == "kda":
        return lambda L, up: reference.kda(*L, use_qk_l2norm=True, upcast=up)[0]
    if op == "diag":
        return lambda L, up: reference.gated_diag(*L, upcast=up)[0]
    s0 = t["state"].detach().clone()
    if op == "kda_decode":
        return lambda L, up: reference.kda(*L, use_qk_l2norm=True,
                                           initial_state=s0.to(reference.accumulation_dtype(L[0].dtype)),
                                           upcast=up)[0]
    if op == "diag_decode":
        return lambda L, up: reference.gated_diag(*L, initial_state=s0.to(reference.accumulation_dtype(L[0].dtype)),
                                                  upcast=up)[0]
    raise ValueError(op)


def work(case: Dict) -> float:
    """Relative cost, used to predict the time of the next size from the last measured one."""
    op = case["op"]
    if op == "flash":
        return case["B"] * case["H"] * case["S"] * case["S"] * case["D"]
    if op in ("flash_decode", "kvcache_decode"):
        return case["B"] * case["Hk"] * case["ctx"] * case["D"]
    if op == "flash_varlen":
        return sum(x * x for x in case["seqlens"]) * case["H"] * case["D"]
    return float(tokens(case) * case["H"] * case["D"])


def state_bytes_per_seq(case: Dict) -> int:
    """Decode memory per sequence: the KV cache (attention) or the recurrent state (fp32)."""
    op = case["op"]
    if op in ("flash_decode", "kvcache_decode"):
        return 2 * case["ctx"] * case["Hk"] * case["D"] * case.get("elt", 2)
    if op == "kda_decode":
        return case["H"] * case["D"] * case["D"] * 4
    if op == "diag_decode":
        return case["H"] * case["D"] * 4
    return 0
