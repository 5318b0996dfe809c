"""``flash_attn_with_kvcache`` on the Triton backend on a CUDA GPU (marked `gpu`): bf16 / fp16 / fp32 against
the float64 reference (contiguous and paged caches, GQA, rotary, windows, softcap, ALiBi, left padding,
splits), the issue's shape (B = 64, cache 8K, Hq = 32, Hk = 8, D = 128), CUDA-graph capture + replay equal to
eager (with cache lengths changed between replays: nothing is baked into the graph), and torch.compile."""
import pytest
import torch

import delta_attn as da
from delta_attn.testing import assert_close
from kvcache_cases import check_triton, clone, make_case, ref

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

CASES = {
    "contiguous_gqa4_d128": dict(group=4, d=128, s_cache=1000, b=3),
    "paged16_gqa8_d128": dict(group=8, hk=1, d=128, paged=True, page=16, s_cache=700, b=3),
    "paged256_d64_sq4_snew4": dict(paged=True, page=256, d=64, s_cache=1500, sq=4, snew=4),
    "rotary_interleaved_window": dict(d=128, rotary=64, window=(100, 0), s_cache=600, sq=2, snew=2),
    "rotary_half_noncausal_leftpad": dict(d=96, rotary=32, interleaved=False, causal=False, leftpad=True, s_cache=500),
    "softcap_alibi_batch_idx": dict(d=128, softcap=20.0, alibi="bh", batch_idx=True, s_cache=900, b=4),
    "sq64_prefill_chunk": dict(d=128, sq=64, snew=64, group=4, s_cache=1200),
    "d256_zero_row": dict(d=256, zero_row=True, s_cache=333, snew=0, causal=False),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_against_reference(name, dtype, num_splits, poisoned):
    tensors, kw = make_case(17, dtype=dtype, device=DEV, **CASES[name])
    check_triton(tensors, kw, num_splits, key_tol=1e-2)


@pytest.mark.parametrize("paged", [False, True])
def test_issue_shape_bf16(paged, poisoned):
    """B = 64, cache 8K, Hq = 32, Hk = 8, D = 128, one new token, random cache lengths."""
    b, ctx, hq, hk, d, page = 64, 8192, 32, 8, 128, 256
    g = torch.Generator(device=DEV).manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g, device=DEV, dtype=torch.bfloat16)       # noqa: E731
    q, k, v = rand(b, 1, hq, d), rand(b, 1, hk, d), rand(b, 1, hk, d)
    kw = dict(cache_seqlens=torch.randint(0, ctx, (b,), generator=g, device=DEV, dtype=torch.int32), causal=True)
    if paged:
        kc, vc = rand(b * ctx // page, page, hk, d), rand(b * ctx // page, page, hk, d)
        kw["block_table"] = torch.randperm(b * ctx // page, generator=g, device=DEV).view(b, -1).to(torch.int32)
    else:
        kc, vc = rand(b, ctx, hk, d), rand(b, ctx, hk, d)
    tensors = (q, kc, vc, k, v)
    out = da.flash_attn_with_kvcache(*(clone(t) for t in tensors), backend="triton", **kw)
    o64 = ref(tensors, kw, dtype_to=torch.float64)[0]
    olp = ref(tensors, kw, upcast=False)[0]
    assert_close(out, o64, olp, name="out")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_graph_capture_replay_equals_eager(paged, dtype):
    """Captured once; replayed after the cache lengths, q and the new token changed in place: every replay
    equals an eager call on the same values (outputs and caches bit for bit)."""
    tensors, kw = make_case(5, dtype=dtype, device=DEV, b=8, group=4, d=128, s_cache=2048, paged=paged, page=64,
                            rotary=64, leftpad=not paged)
    q, kc, vc, k, v = (clone(t) for t in tensors)
    lens = kw["cache_seqlens"]
    kw["cache_seqlens"] = lens = lens.clamp(max=2000)

    def step():
        return da.flash_attn_with_kvcache(q, kc, vc, k, v, return_softmax_lse=True, backend="triton", **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                                   # compile and fit tiles before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step()
    for trial in range(3):
        with torch.no_grad():
            lens.copy_(torch.randint(1, 2000, lens.shape, device=DEV, dtype=torch.int32))
            if "cache_leftpad" in kw:
                kw["cache_leftpad"].copy_(torch.minimum(kw["cache_leftpad"], lens))
            q.normal_()
            k.normal_()
        kc_e, vc_e = kc.clone(), vc.clone()
        out_e, lse_e = da.flash_attn_with_kvcache(q, kc_e, vc_e, k, v, return_softmax_lse=True, backend="triton",
                                                  **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e), trial
        assert torch.equal(kc, kc_e) and torch.equal(vc, vc_e), trial


def test_capture_skips_value_checks():
    """Inside a capture no value check runs (it would need the host): a call that validation would refuse
    eagerly is captured without an error (the caller vouches for the values)."""
    tensors, kw = make_case(6, dtype=torch.bfloat16, device=DEV, d=128, s_cache=256)
    q, kc, vc, k, v = (clone(t) for t in tensors)
    kw["cache_leftpad"] = kw["cache_seqlens"] + 1                # refused eagerly, harmless in the kernel
    with pytest.raises(ValueError, match="cache_leftpad"):
        da.flash_attn_with_kvcache(q, kc, vc, k, v, backend="triton", **kw)
    kw.pop("cache_leftpad")
    da.flash_attn_with_kvcache(q, kc, vc, k, v, backend="triton", **kw)      # warm
    kw["cache_leftpad"] = kw["cache_seqlens"] + 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        da.flash_attn_with_kvcache(q, kc, vc, k, v, backend="triton", **kw)


def test_compile_fullgraph_matches_eager():
    tensors, kw = make_case(8, dtype=torch.bfloat16, device=DEV, d=128, s_cache=512, paged=True, page=32, rotary=32)
    q, kc, vc, k, v = (clone(t) for t in tensors)
    kc2, vc2 = kc.clone(), vc.clone()

    def f(q, kc, vc, k, v):
        return da.flash_attn_with_kvcache(q, kc, vc, k, v, backend="triton", **kw)
    eager = f(q, kc, vc, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, kc2, vc2, k, v)
    assert torch.equal(eager, compiled)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
