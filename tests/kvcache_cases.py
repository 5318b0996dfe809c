"""Seeded ``flash_attn_with_kvcache`` calls and the reference on copies of their caches (shared by
tests/ops/test_kvcache.py and tests/gpu/test_kvcache_gpu.py)."""
from __future__ import annotations

import math
import random

import torch

import delta_attn as da
from delta_attn import reference
from delta_attn.testing import assert_close


def make_case(seed: int, *, dtype=torch.float16, device="cpu", b=2, sq=1, hk=2, group=2, d=16, paged=False, page=8,
              s_cache=40, snew=1, rotary=None, interleaved=True, leftpad=False, batch_idx=False, causal=True,
              window=(-1, -1), softcap=0.0, alibi=None, scale=None, zero_row=False):
    """Inputs of one call, seeded. ``rotary``: None or the rotary dim; ``alibi``: None, "h" or "bh"."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    hq = hk * group

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    q = randn(b, sq, hq, d)
    kw = dict(causal=causal, window_size=window, softcap=softcap, softmax_scale=scale,
              rotary_interleaved=interleaved)
    if paged:
        max_blocks = -(-s_cache // page)
        num_blocks = b * max_blocks + 3
        k_cache, v_cache = randn(num_blocks, page, hk, d), randn(num_blocks, page, hk, d)
        kw["block_table"] = torch.randperm(num_blocks, generator=g)[:b * max_blocks].view(b, max_blocks).to(torch.int32)
        capacity = max_blocks * page
    else:
        b_cache = b + 2 if batch_idx else b
        k_cache, v_cache = randn(b_cache, s_cache, hk, d), randn(b_cache, s_cache, hk, d)
        if batch_idx:
            kw["cache_batch_idx"] = torch.randperm(b_cache, generator=g)[:b].to(torch.int32)
        capacity = s_cache
    k = v = None
    if snew:
        k, v = randn(b, snew, hk, d), randn(b, snew, hk, d)
    seqlens = [rnd.randint(0, capacity - snew) for _ in range(b)]
    if zero_row:
        seqlens[0] = 0
    kw["cache_seqlens"] = torch.tensor(seqlens, dtype=torch.int32)
    if leftpad:
        kw["cache_leftpad"] = torch.tensor([rnd.randint(0, n) for n in seqlens], dtype=torch.int32)
    if rotary:
        ang = torch.rand(capacity + sq, rotary // 2, generator=g) * 2 * math.pi
        kw["rotary_cos"], kw["rotary_sin"] = ang.cos().to(dtype), ang.sin().to(dtype)
    if alibi == "h":
        kw["alibi_slopes"] = torch.rand(hq, generator=g) * 0.3
    elif alibi == "bh":
        kw["alibi_slopes"] = torch.rand(b, hq, generator=g) * 0.3
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t      # noqa: E731
    return tuple(to(t) for t in (q, k_cache, v_cache, k, v)), {n: to(x) for n, x in kw.items()}


def clone(t):
    return None if t is None else t.clone()


def f64(t):
    return None if t is None else (t.to(torch.float64) if t.is_floating_point() else t)


def ref(tensors, kw, dtype_to=None, upcast=True):
    """The reference on copies of the caches; returns (out, lse, k_cache, v_cache)."""
    q, kc, vc, k, v = (clone(t) for t in tensors)
    kw = dict(kw)
    if dtype_to is not None:
        q, kc, vc, k, v = (f64(t) for t in (q, kc, vc, k, v))
        for name in ("rotary_cos", "rotary_sin"):
            if name in kw:
                kw[name] = f64(kw[name])
    out, lse = reference.attention_with_kvcache(q, kc, vc, k, v, upcast=upcast, **kw)
    return out, lse, kc, vc


def check_triton(tensors, kw, num_splits: int, key_tol: float, exact_uncached_keys: bool = False) -> None:
    """The Triton backend on copies of ``tensors`` against the reference: out and lse by the error rule (docs/TESTING.md),
    the cache writes (values copied exactly; keys rotated in float32 and rounded once, within ``key_tol``,
    exactly when there is no rotary and ``exact_uncached_keys``)."""
    q, kc, vc, k, v = (clone(t) for t in tensors)
    out, lse = da.flash_attn_with_kvcache(q, kc, vc, k, v, num_splits=num_splits, return_softmax_lse=True,
                                          backend="triton", **kw)
    o64, l64, _, _ = ref(tensors, kw, dtype_to=torch.float64)
    olp, llp, _, _ = ref(tensors, kw, upcast=False)
    assert_close(out, o64, olp, name="out")
    assert_close(lse, l64, llp, name="lse")
    _, _, kc_ref, vc_ref = ref(tensors, kw)
    assert torch.equal(vc, vc_ref)
    torch.testing.assert_close(kc, kc_ref, rtol=key_tol, atol=key_tol)
    if exact_uncached_keys and "rotary_cos" not in kw:
        assert torch.equal(kc, kc_ref)
