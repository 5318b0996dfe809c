"""``flash_attn_with_kvcache``: the reference against an independent per-sequence oracle built on
``flash_attn_func``, the Triton kernels (CPU interpreter) against the float64 reference with the error
rule, the in-place cache writes, a decode loop against one dense call, and the validation catalogue."""
from __future__ import annotations

import pytest
import torch

import delta_attn as da
from delta_attn import _checks, reference
from delta_attn.testing import assert_close
from kvcache_cases import check_triton, clone as _clone, f64 as _f64, make_case, ref as _ref

# ------------------------------------------------------------------------------------------------ oracle


def _rope_complex(x, cos, sin, positions, interleaved):
    """Rotary through complex multiplication (independent of reference.rotary's formulation)."""
    r = 2 * cos.shape[1]
    rot = torch.complex(cos[positions].double(), sin[positions].double())[:, None, :]     # (S, 1, R/2)
    xr = x[..., :r].double()
    if interleaved:
        z = torch.view_as_complex(xr.reshape(*xr.shape[:-1], r // 2, 2).contiguous()) * rot
        y = torch.view_as_real(z).flatten(-2)
    else:
        z = torch.complex(xr[..., :r // 2], xr[..., r // 2:]) * rot
        y = torch.cat([z.real, z.imag], -1)
    return torch.cat([y, x[..., r:].double()], -1)


def _oracle(tensors, kw):
    """Per sequence: the logical cache as a plain tensor, the new keys written in, then one
    ``flash_attn_func(backend="torch")`` call on positions lp .. n + Snew - 1. float64."""
    q, kc, vc, k, v = (_f64(t) for t in tensors)
    b, sq = q.shape[:2]
    snew = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for i in range(b):
        if "block_table" in kw:
            blocks = kw["block_table"][i].long()
            lk, lv = kc[blocks].flatten(0, 1).clone(), vc[blocks].flatten(0, 1).clone()
        else:
            row = int(kw["cache_batch_idx"][i]) if "cache_batch_idx" in kw else i
            lk, lv = kc[row].clone(), vc[row].clone()
        n = int(kw["cache_seqlens"][i])
        lp = int(kw["cache_leftpad"][i]) if "cache_leftpad" in kw else 0
        qi = q[i]
        if snew:
            ki = k[i]
            if "rotary_cos" in kw:
                ki = _rope_complex(ki, kw["rotary_cos"], kw["rotary_sin"], torch.arange(n, n + snew),
                                   kw["rotary_interleaved"])
            lk[n:n + snew], lv[n:n + snew] = ki, v[i]
        if "rotary_cos" in kw:
            per_query = kw["causal"] or kw["window_size"] != (-1, -1)
            pos = torch.arange(n, n + sq) if per_query else torch.full((sq,), n)
            qi = _rope_complex(qi, kw["rotary_cos"], kw["rotary_sin"], pos, kw["rotary_interleaved"])
        alibi = kw.get("alibi_slopes")
        if alibi is not None and alibi.dim() == 2:
            alibi = alibi[i]
        o, lse, _ = da.flash_attn_func(qi[None], lk[None, lp:n + snew], lv[None, lp:n + snew],
                                       softmax_scale=kw["softmax_scale"], causal=kw["causal"],
                                       window_size=kw["window_size"], softcap=kw["softcap"],
                                       alibi_slopes=None if alibi is None else alibi.double().float(),
                                       return_attn_probs=True, backend="torch")
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


ORACLE_CASES = {
    "plain": dict(),
    "gqa4_sq3_window": dict(group=4, sq=3, snew=2, window=(5, 1), causal=False),
    "paged_rotary_half": dict(paged=True, page=4, rotary=8, interleaved=False),
    "rotary_interleaved_noncausal": dict(rotary=16, causal=False, sq=2, snew=2),
    "leftpad_batch_idx_alibi": dict(leftpad=True, batch_idx=True, alibi="bh", sq=2),
    "softcap_scale_alibi_h": dict(softcap=3.0, scale=-0.4, alibi="h", group=1),
    "no_new_kv_zero_row": dict(snew=0, zero_row=True, causal=False, paged=True),
    "sq_gt_keys_causal": dict(sq=4, snew=1, zero_row=True),
}


@pytest.mark.parametrize("name", list(ORACLE_CASES))
def test_reference_matches_per_sequence_flash_attn(name):
    tensors, kw = make_case(11, dtype=torch.float64, **ORACLE_CASES[name])
    out, lse, kc, vc = _ref(tensors, kw)
    o_or, l_or = _oracle(tensors, kw)
    torch.testing.assert_close(out, o_or, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, l_or, rtol=1e-10, atol=1e-10)
    # the public torch backend is the reference, and writes the caches in place
    q, k_cache, v_cache, k, v = (_clone(t) for t in tensors)
    o2, l2 = da.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, return_softmax_lse=True, backend="torch", **kw)
    torch.testing.assert_close(o2, out, rtol=0, atol=0)
    torch.testing.assert_close(l2, lse, rtol=0, atol=0)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)


def test_reference_writes_only_the_new_positions():
    tensors, kw = make_case(3, dtype=torch.float64, snew=2, paged=True, page=4, rotary=8)
    q, kc0, vc0, k, v = tensors
    _, _, kc, vc = _ref(tensors, kw)
    changed = (kc != kc0).any(-1).any(-1) | (vc != vc0).any(-1).any(-1)        # (num_blocks, page)
    expected = torch.zeros_like(changed)
    for i, n in enumerate(kw["cache_seqlens"].tolist()):
        for p in range(n, n + 2):
            expected[kw["block_table"][i, p // 4], p % 4] = True
    assert torch.equal(changed, expected)


def test_decode_loop_equals_one_dense_call():
    """Prefill a prompt into the cache, then decode token by token: every output row equals the causal
    dense attention over the whole sequence (rotary applied the same way to both)."""
    torch.manual_seed(5)
    b, prompt, steps, hk, hq, d = 2, 6, 5, 2, 4, 16
    total = prompt + steps
    q, k, v = torch.randn(b, total, hq, d, dtype=torch.float64), *torch.randn(2, b, total, hk, d, dtype=torch.float64)
    ang = torch.rand(total, 4, dtype=torch.float64) * 6
    cos, sin = ang.cos(), ang.sin()
    k_cache, v_cache = torch.zeros(b, 16, hk, d, dtype=torch.float64), torch.zeros(b, 16, hk, d, dtype=torch.float64)
    outs = [da.flash_attn_with_kvcache(q[:, :prompt], k_cache, v_cache, k[:, :prompt], v[:, :prompt], cos, sin,
                                       cache_seqlens=0, causal=True, backend="torch")]
    for t in range(prompt, total):
        outs.append(da.flash_attn_with_kvcache(q[:, t:t + 1], k_cache, v_cache, k[:, t:t + 1], v[:, t:t + 1], cos, sin,
                                               cache_seqlens=torch.full((b,), t, dtype=torch.int32), causal=True,
                                               backend="torch"))
    pos = torch.arange(total)
    rq = torch.stack([reference.rotary(q[i], cos, sin, pos) for i in range(b)])
    rk = torch.stack([reference.rotary(k[i], cos, sin, pos) for i in range(b)])
    dense = da.flash_attn_func(rq, rk, v, causal=True, backend="torch")
    torch.testing.assert_close(torch.cat(outs, 1), dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_cache[:, :total], rk, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ triton

TRITON_CASES = {
    "contiguous_gqa2": dict(),
    "contiguous_splits3": dict(num_splits=3, s_cache=47),
    "paged_gqa4_splits2": dict(paged=True, page=8, group=4, num_splits=2),
    "paged_page3_sq3_snew2": dict(paged=True, page=3, sq=3, snew=2, s_cache=25),
    "mqa_d24_window": dict(hk=1, group=4, d=24, window=(7, 0), causal=False, num_splits=2),
    "rotary_interleaved_causal": dict(rotary=16, sq=2, snew=2),
    "rotary_half_noncausal_paged": dict(rotary=8, interleaved=False, causal=False, paged=True, page=4),
    "leftpad_batch_idx": dict(leftpad=True, batch_idx=True, b=3, num_splits=2),
    "softcap_alibi_bh": dict(softcap=2.5, alibi="bh", sq=2, snew=2),
    "alibi_h_negative_scale": dict(alibi="h", scale=-0.3, group=1),
    "no_new_kv_zero_row": dict(snew=0, zero_row=True, causal=False, num_splits=3),
    "empty_rows_sq_gt_keys": dict(sq=4, snew=1, zero_row=True, group=1),
    "fp32_paged_window_splits": dict(dtype=torch.float32, paged=True, page=5, window=(9, 2), num_splits=3),
    "fp32_rotary_leftpad": dict(dtype=torch.float32, rotary=16, interleaved=False, leftpad=True, sq=2, snew=2),
}


@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_against_reference(name, poisoned):
    opts = dict(TRITON_CASES[name])
    num_splits = opts.pop("num_splits", 0)
    tensors, kw = make_case(7, **opts)
    check_triton(tensors, kw, num_splits, key_tol=2e-3, exact_uncached_keys=True)


HOIST_CASES = {
    "contiguous_splits3": dict(num_splits=3, s_cache=47),
    "paged_page3_sq3_snew2": dict(paged=True, page=3, sq=3, snew=2, s_cache=25),
    "mqa_d24_window": dict(hk=1, group=4, d=24, window=(7, 0), causal=False, num_splits=2),
    "window_both_sq3_long": dict(window=(20, 3), causal=False, sq=3, snew=2, s_cache=90, num_splits=2),
    "leftpad_batch_idx_causal_sq2": dict(leftpad=True, batch_idx=True, b=3, sq=2, s_cache=70),
    "empty_rows_sq_gt_keys": dict(sq=4, snew=1, zero_row=True, group=1),
    "fp32_paged_window_splits": dict(dtype=torch.float32, paged=True, page=5, window=(9, 2), num_splits=3),
    "noncausal_no_window_paged": dict(causal=False, paged=True, page=8, s_cache=77, sq=2),
}


@pytest.mark.parametrize("name", list(HOIST_CASES))
def test_triton_hoisted_masks_against_reference(name, poisoned):
    """The launcher's explicit config with HOIST=1 (unmasked interior tiles, masked edge tiles) == the
    float64 reference by the error rule, over windows, splits, pages, left padding and empty rows."""
    from delta_attn.ops._launch import tiles
    from delta_attn.ops.flash import autograd
    from delta_attn.ops.flash.api import validate_kvcache as validate
    opts = dict(HOIST_CASES[name])
    num_splits = opts.pop("num_splits", 0)
    tensors, kw = make_case(11, **opts)
    a = validate(*(_clone(t) for t in tensors), num_splits=num_splits, return_softmax_lse=True, **kw)
    out, lse = autograd.kvcache(a, config=tiles("test", BLOCK_N=16, HOIST=1))
    o64, l64, _, _ = _ref(tensors, kw, dtype_to=torch.float64)
    olp, llp, _, _ = _ref(tensors, kw, upcast=False)
    assert_close(out, o64, olp, name="out")
    assert_close(lse, l64, llp, name="lse")


def test_triton_hoisted_window_edges():
    """HOIST=1 at the edge tiles: seeded windows (both bounds, one, none) and cache lengths chosen so that the
    unmasked interior's bounds land on and next to tile edges (an off-by-one there shows), three queries."""
    from delta_attn.ops._launch import tiles
    from delta_attn.ops.flash import autograd
    from delta_attn.ops.flash.api import validate_kvcache as validate
    import random
    rnd = random.Random(5)
    combos = [(30, 29, -1), (40, 12, 2), (60, 20, 10), (48, -1, 0), (40, 14, 0), (50, 13, 1), (31, -1, 1)]
    combos += [(rnd.randint(0, 76), rnd.choice([-1] + list(range(34))), rnd.choice([-1] + list(range(34))))
               for _ in range(15)]
    for n0, wl, wr in combos:
        tensors, kw = make_case(n0, b=1, sq=3, hk=1, group=1, s_cache=80, window=(wl, wr), causal=False)
        kw["cache_seqlens"] = torch.tensor([n0], dtype=torch.int32)
        a = validate(*(_clone(t) for t in tensors), return_softmax_lse=True, **kw)
        out, lse = autograd.kvcache(a, config=tiles("test", BLOCK_N=16, HOIST=1))
        o64, l64, _, _ = _ref(tensors, kw, dtype_to=torch.float64)
        olp, llp, _, _ = _ref(tensors, kw, upcast=False)
        assert_close(out, o64, olp, name=f"out n0={n0} window=({wl}, {wr})")
        assert_close(lse, l64, llp, name=f"lse n0={n0} window=({wl}, {wr})")


@pytest.mark.parametrize("config, err, match", [
    ("x", TypeError, "config must be a delta_attn.ops._launch.Tiles"),
    (dict(BLOCK_N=16), ValueError, "config.meta must name exactly"),
    (dict(BLOCK_N=24, HOIST=0), ValueError, "BLOCK_N must be a power of two"),
    (dict(BLOCK_N=16, HOIST=2), ValueError, "HOIST must be 0 or 1"),
])
def test_triton_config_rejected(config, err, match):
    from delta_attn.ops._launch import tiles
    from delta_attn.ops.flash import autograd
    from delta_attn.ops.flash.api import validate_kvcache as validate
    tensors, kw = make_case(0)
    a = validate(*tensors, **kw)
    with pytest.raises(err, match=match):
        autograd.kvcache(a, config=tiles("test", **config) if isinstance(config, dict) else config)


def test_triton_splits_agree():
    """The same call with 1, 2 and 5 splits (and the shape heuristic) gives the same result up to rounding."""
    tensors, kw = make_case(2, s_cache=45, snew=0)
    outs = [da.flash_attn_with_kvcache(*tensors, num_splits=n, return_softmax_lse=True, backend="triton", **kw)
            for n in (0, 1, 2, 5)]
    for o, lse in outs[1:]:
        torch.testing.assert_close(o, outs[0][0], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(lse, outs[0][1], rtol=1e-5, atol=1e-5)


def test_split_rule_uses_shapes_only():
    from delta_attn.ops.flash.launch import choose_splits
    assert choose_splits(64 * 8, 8192, 132) == 1                        # the GPU is full: no merge pass
    assert choose_splits(8, 1 << 16, 132) == triton_cdiv(2 * 132, 8)    # few programs: split to fill the SMs
    assert choose_splits(8, 300, 132) == 2                              # but not below 256 keys per split
    assert choose_splits(1, 1 << 20, 132) == 64                         # and at most 64


def triton_cdiv(a, b):
    return -(-a // b)


def test_explain_names_the_op_and_the_backend():
    tensors, kw = make_case(0)
    ex = da.explain("flash_attn_with_kvcache", *tensors, **kw)
    assert ex.call.op == "flash_kvcache" and ex.chosen == "triton"
    assert {"causal", "gqa", "new_kv"} <= ex.call.features
    bf = [t.to(torch.bfloat16) if t is not None else None for t in tensors]
    ex = da.explain(da.flash_attn_with_kvcache, *bf, **kw)
    assert ex.chosen == "torch" and "bfloat16" in str(ex)


def test_refuses_gradients():
    tensors, kw = make_case(0, dtype=torch.float32)
    q = tensors[0].requires_grad_(True)
    with pytest.raises(da.UnsupportedError, match="no backward pass"):
        da.flash_attn_with_kvcache(q, *tensors[1:], **kw)
    with torch.no_grad():
        da.flash_attn_with_kvcache(q, *tensors[1:], backend="torch", **kw)


# ------------------------------------------------------------------------------------------------ validation


def _base():
    tensors, kw = make_case(1, dtype=torch.float32, paged=True, page=4, s_cache=16, rotary=8)
    return list(tensors), kw


def _mut(**changes):
    def f():
        (q, kc, vc, k, v), kw = _base()
        t = dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v)
        for name, value in changes.items():
            value = value(t, kw) if callable(value) else value
            if name in t:
                t[name] = value
            elif value is _DROP:
                kw.pop(name)
            else:
                kw[name] = value
        return (t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"]), kw
    return f


_DROP = object()

BAD = [
    ("q not a tensor", _mut(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    ("q 3-D", _mut(q=lambda t, kw: t["q"][0]), ValueError, "q must be 4-D"),
    ("k_cache dtype", _mut(k_cache=lambda t, kw: t["k_cache"].double()), TypeError, "k_cache must have the dtype of q"),
    ("v_cache shape", _mut(v_cache=lambda t, kw: t["v_cache"][:-1]), ValueError, "v_cache must have shape"),
    ("head dim", _mut(k_cache=lambda t, kw: t["k_cache"][..., :8], v_cache=lambda t, kw: t["v_cache"][..., :8]),
     ValueError, "k_cache head dim must equal q's"),
    ("heads", _mut(q=lambda t, kw: t["q"][:, :, :3]), ValueError, r"q heads \(3\) must be a multiple of k_cache heads"),
    ("k without v", _mut(v=None), ValueError, "k and v must be given together"),
    ("k shape", _mut(k=lambda t, kw: t["k"][:, :, :1], v=lambda t, kw: t["v"][:, :, :1]), ValueError,
     "k must have shape"),
    ("v shape", _mut(v=lambda t, kw: torch.cat([t["v"], t["v"]], 1)), ValueError, "v must have shape"),
    ("k without cache_seqlens", _mut(cache_seqlens=None), ValueError, "cache_seqlens is required"),
    ("cache_seqlens type", _mut(cache_seqlens=2.0), TypeError, "cache_seqlens must be an int"),
    ("cache_seqlens dtype", _mut(cache_seqlens=lambda t, kw: kw["cache_seqlens"].float()), TypeError,
     "cache_seqlens must be int32 or int64"),
    ("cache_seqlens shape", _mut(cache_seqlens=lambda t, kw: kw["cache_seqlens"][:1]), ValueError,
     "cache_seqlens must have shape"),
    ("cache_seqlens negative", _mut(cache_seqlens=lambda t, kw: torch.tensor([-1, 0], dtype=torch.int32)),
     ValueError, "cache_seqlens must be >= 0"),
    ("cache too short (paged)", _mut(cache_seqlens=lambda t, kw: torch.tensor([3, 16], dtype=torch.int32)),
     ValueError, r"the cache is too short.*block_table.shape\[1\] \* page_size.*batch row 1"),
    ("cache too short (int)", _mut(cache_seqlens=16), ValueError, "the cache is too short"),
    ("block index out of range", _mut(block_table=lambda t, kw: kw["block_table"].index_fill(1, torch.tensor([0]), 99)),
     ValueError, r"block_table entries must lie in \[0, 11\).*got 99 at block_table\[0, 0\]"),
    ("block index negative", _mut(block_table=lambda t, kw: kw["block_table"].index_fill(1, torch.tensor([0]), -1)),
     ValueError, r"block_table entries must lie in .*got -1"),
    ("block_table dtype", _mut(block_table=lambda t, kw: kw["block_table"].float()), TypeError,
     "block_table must be int32 or int64"),
    ("block_table batch", _mut(block_table=lambda t, kw: kw["block_table"][:1]), ValueError,
     "block_table batch size must equal q's"),
    ("cache_batch_idx with block_table", _mut(cache_batch_idx=lambda t, kw: torch.tensor([0, 1], dtype=torch.int32)),
     ValueError, "cache_batch_idx must be None with a paged cache"),
    ("cache_leftpad beyond cache_seqlens", _mut(cache_leftpad=lambda t, kw: kw["cache_seqlens"] + 1), ValueError,
     r"cache_leftpad must lie in \[0, cache_seqlens\]"),
    ("cache_leftpad shape", _mut(cache_leftpad=lambda t, kw: torch.zeros(3, dtype=torch.int32)), ValueError,
     "cache_leftpad must have shape"),
    ("rotary_cos alone", _mut(rotary_sin=None), ValueError, "rotary_cos and rotary_sin must be given together"),
    ("rotary without k", _mut(k=None, v=None), ValueError, "rotary_cos / rotary_sin need k / v"),
    ("rotary dim", _mut(rotary_cos=lambda t, kw: torch.ones(20, 9), rotary_sin=lambda t, kw: torch.ones(20, 9)),
     ValueError, r"rotary_cos.shape\[1\] \(rotary_dim / 2\) must be in \[1, 8\]"),
    ("rotary_sin shape", _mut(rotary_sin=lambda t, kw: kw["rotary_sin"][:, :2]), ValueError, "rotary_sin must have shape"),
    ("rotary dtype", _mut(rotary_cos=lambda t, kw: kw["rotary_cos"].double()), TypeError, "rotary_cos must be float32"),
    ("rotary table too short", _mut(rotary_cos=lambda t, kw: kw["rotary_cos"][:2], rotary_sin=lambda t, kw: kw["rotary_sin"][:2]),
     ValueError, "rotary_cos / rotary_sin must cover every rotated position"),
    ("num_splits", _mut(num_splits=-1), ValueError, "num_splits must be an int >= 0"),
    ("num_splits bool", _mut(num_splits=True), ValueError, "num_splits must be an int >= 0"),
    ("softcap", _mut(softcap=-1.0), ValueError, "softcap must be >= 0"),
    ("softmax_scale", _mut(softmax_scale=float("nan")), ValueError, "softmax_scale must be"),
    ("window", _mut(window_size=(-2, 0)), ValueError, "window_size entries must be >= -1"),
    ("alibi shape", _mut(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape"),
    ("alibi dtype", _mut(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes must be float32"),
    ("causal", _mut(causal=1), TypeError, "causal must be a bool"),
    ("return_softmax_lse", _mut(return_softmax_lse=1), TypeError, "return_softmax_lse must be a bool"),
    ("rotary_interleaved", _mut(rotary_interleaved="yes"), TypeError, "rotary_interleaved must be a bool"),
    ("device", _mut(k_cache=lambda t, kw: t["k_cache"].to("meta"), v_cache=lambda t, kw: t["v_cache"].to("meta")),
     ValueError, "k_cache must be on the device of q"),
]


@pytest.mark.parametrize("what,make,exc,match", BAD, ids=[b[0] for b in BAD])
def test_validation_names_the_argument(what, make, exc, match):
    tensors, kw = make()
    with pytest.raises(exc, match=match):
        da.flash_attn_with_kvcache(*tensors, backend="torch", **kw)


def _contiguous_base():
    tensors, kw = make_case(4, dtype=torch.float32, batch_idx=True, s_cache=12)
    return list(tensors), kw


@pytest.mark.parametrize("what,change,match", [
    ("cache_batch_idx out of range", lambda kw: kw.update(cache_batch_idx=torch.tensor([0, 4], dtype=torch.int32)),
     r"cache_batch_idx must lie in \[0, 4\)"),
    ("cache_batch_idx repeats", lambda kw: kw.update(cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32)),
     "cache_batch_idx must not repeat"),
    ("k_cache batch without cache_batch_idx", lambda kw: kw.pop("cache_batch_idx"), "k_cache batch size must equal q's"),
])
def test_validation_contiguous(what, change, match):
    tensors, kw = _contiguous_base()
    change(kw)
    with pytest.raises(ValueError, match=match):
        da.flash_attn_with_kvcache(*tensors, backend="torch", **kw)


def test_unused_block_table_entries_are_not_checked():
    """Entries past the pages a sequence uses may hold anything (serving stacks pad with -1)."""
    tensors, kw = _base()
    kw["cache_seqlens"] = torch.tensor([2, 3], dtype=torch.int32)      # + 1 new token: one page each
    kw["block_table"][:, 1:] = -1
    ref = da.flash_attn_with_kvcache(*[_clone(t) for t in tensors], backend="torch", **kw)
    out = da.flash_attn_with_kvcache(*[_clone(t) for t in tensors], backend="triton", **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_value_checks_are_skipped_under_capture(monkeypatch):
    """A CUDA graph cannot capture a host read: while capturing, validation keeps its shape checks and
    leaves the value checks to the caller (documented)."""
    tensors, kw = _base()
    kw["cache_leftpad"] = kw["cache_seqlens"] + 1
    from delta_attn.ops.flash.api import validate_kvcache
    with pytest.raises(ValueError, match="cache_leftpad"):
        validate_kvcache(*tensors, **kw)
    monkeypatch.setattr(_checks, "_capturing", lambda: True)
    validate_kvcache(*tensors, **kw)
    with pytest.raises(ValueError, match="k_cache head dim"):
        validate_kvcache(tensors[0][..., :8], *tensors[1:], **kw)


def test_custom_op_fake_matches_real():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from delta_attn.ops.flash import autograd  # noqa: F401  (registers the op)
    tensors, kw = make_case(0)
    q, kc, vc, k, v = tensors
    args = (q, kc, vc, k, v, None, None, kw["cache_seqlens"], None, None, None, None, 0.25, -1, 0, 0.0, True, True, 2)
    real = [(tuple(o.shape), o.dtype, o.stride()) for o in torch.ops.delta_attn.flash_kvcache(*args)]
    with FakeTensorMode() as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = [(tuple(o.shape), o.dtype, o.stride()) for o in torch.ops.delta_attn.flash_kvcache(*fargs)]
    assert fake == real


# ------------------------------------------------------------------------------------------------ bench peers


@pytest.mark.parametrize("page", [0, 4])
def test_bench_peer_steps_match_their_reference(page):
    """The SDPA peer's step (append, then the GQA groups as query rows over the cache) and the paged append
    the cuDNN peer uses, run on CPU against the float64 reference the gate applies."""
    from delta_attn.bench import cases, impls
    case = dict(op="kvcache_decode", B=2, ctx=16, H=4, Hk=2, D=16, page=page)
    t = cases.make_inputs(case, torch.device("cpu"), torch.float32, seed=3)
    ours = {k: _clone(v) for k, v in t.items()}
    out_ours = da.flash_attn_with_kvcache(*impls._call_args("kvcache_decode", case, ours)[0], backend="torch",
                                          **impls._call_args("kvcache_decode", case, ours)[1])
    impls._append_last(t)
    assert torch.equal(t["k_cache"], ours["k_cache"]) and torch.equal(t["v_cache"], ours["v_cache"])
    spec = impls._kvcache_spec(case, t)
    leaves = [t["q"].double(), t["k_cache"].double(), t["v_cache"].double()]
    torch.testing.assert_close(spec(leaves, True).float(), out_ours, rtol=1e-5, atol=1e-5)
    if not page:
        b = impls._sdpa_kvcache_bind("FA2 (SDPA flash)")(case, t)     # run outside its CUDA-only context
        torch.testing.assert_close(b.fn(), out_ours, rtol=1e-5, atol=1e-5)
