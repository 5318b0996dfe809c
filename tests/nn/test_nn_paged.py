"""The paged KV cache of the attention layer and the hybrid model's decode paths (delta_attn.nn).

float64 on the ``torch`` backend: decoding from a :class:`PagedKVCache` must equal decoding from the
growing :class:`KVCache` and one full forward to ~1e-12 (pages of 3 tokens, so every call crosses page
boundaries); ``generate`` with the paged cache gives the tokens of the non-paged path, greedy and sampled.
The Triton kernels (interpreter on a CPU) are compared with the ``torch`` backend in float32. The CUDA
graph path is tested in tests/gpu/test_hybrid_decode_gpu.py.
"""
import pytest
import torch

import delta_attn.nn as dnn

DT = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)
C = 24


def attention(backend="torch", dtype=DT, **kw):
    return dnn.MultiheadAttention(C, num_heads=4, num_kv_heads=2, head_dim=6, backend=backend, **kw).to(dtype).eval()


def tiny_lm(pattern="KDKA", dtype=DT, backend="torch"):
    cfg = dnn.HybridConfig(vocab_size=23, hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1,
                           pattern=pattern, backend=backend)
    return dnn.HybridLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("window", [(-1, -1), (3, 0)])
def test_paged_decoding_matches_full_forward_and_kv_cache(window):
    torch.manual_seed(0)
    layer = attention(window_size=window)
    x = torch.randn(2, 11, C, dtype=DT)
    with torch.no_grad():
        full = layer(x)
        paged, grow = dnn.PagedKVCache(max_seqlen=11, page_size=3), dnn.KVCache()
        outs = []
        for lo, hi in ((0, 4), (4, 6), (6, 7), (7, 8), (8, 11)):   # prefill, chunks, single tokens
            outs.append(layer(x[:, lo:hi], cache=paged))
            torch.testing.assert_close(outs[-1], layer(x[:, lo:hi], cache=grow), **TOL)
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)
    assert paged.cache_seqlens.tolist() == [11, 11]
    # rotary keys in the pages == the growing cache's keys
    pages = paged.block_table.long()
    k = paged.k_pages[pages].flatten(1, 2)[:, :11]
    torch.testing.assert_close(k, grow.k, **TOL)


def test_paged_decoding_after_padded_and_varlen_prefill():
    torch.manual_seed(1)
    layer = attention()
    t = 7
    x = torch.randn(3, t, C, dtype=DT)
    mask = torch.zeros(3, t, dtype=torch.bool)
    mask[0, 4:] = True           # left padding
    mask[1, :] = True
    mask[2, :5] = True           # right padding
    nxt = torch.randn(3, 2, C, dtype=DT)
    with torch.no_grad():
        paged, grow = dnn.PagedKVCache(max_seqlen=9, page_size=3), dnn.KVCache()
        out = layer(x, attention_mask=mask, cache=paged)
        torch.testing.assert_close(out, layer(x, attention_mask=mask, cache=grow), **TOL)
        assert paged.cache_seqlens.tolist() == [3, 7, 5]
        for i in range(2):
            torch.testing.assert_close(layer(nxt[:, i:i + 1], cache=paged), layer(nxt[:, i:i + 1], cache=grow), **TOL)
        # varlen prefill (an empty and a length-1 sequence), then one dense step per sequence
        cu = torch.tensor([0, 4, 4, 5, 9], dtype=torch.int32)
        xv = torch.randn(1, 9, C, dtype=DT)
        paged, grow = dnn.PagedKVCache(max_seqlen=6, page_size=3), dnn.KVCache()
        torch.testing.assert_close(layer(xv, cu_seqlens=cu, cache=paged), layer(xv, cu_seqlens=cu, cache=grow), **TOL)
        step = torch.randn(4, 1, C, dtype=DT)
        torch.testing.assert_close(layer(step, cache=paged), layer(step, cache=grow), **TOL)
        assert paged.cache_seqlens.tolist() == [5, 1, 2, 5]


def test_paged_cache_pages_limits_and_reorder():
    layer = attention()
    x = torch.randn(2, 4, C, dtype=DT)
    with torch.no_grad():
        cache = dnn.PagedKVCache(max_seqlen=6, page_size=2, num_blocks=5)
        layer(x, cache=cache)                                    # 2 pages per row
        assert sorted(cache.block_table[:, :2].flatten().tolist()) == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="out of pages"):   # 2 more rows' pages, 1 free
            layer(x[:, :2], cache=cache)
        with pytest.raises(ValueError, match="attention_mask"):
            layer(x[:, :1], attention_mask=torch.ones(2, 1, dtype=torch.bool), cache=cache)
        cache.reorder(torch.tensor([1]))                          # row 0 dropped: its pages are free again
        kept = attention()
        kept.load_state_dict(layer.state_dict())
        ref = dnn.KVCache()
        kept(x[1:], cache=ref)
        torch.testing.assert_close(layer(x[1:, :2], cache=cache), kept(x[1:, :2], cache=ref), **TOL)
        with pytest.raises(ValueError, match="max_seqlen = 6"):
            layer(x[1:, :1], cache=cache)
        with pytest.raises(ValueError, match="distinct rows"):
            cache.reorder(torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="page_size"):
        dnn.PagedKVCache(max_seqlen=4, page_size=0)


def test_generate_paged_equals_growing_cache_greedy_sampled_and_padded():
    torch.manual_seed(2)
    model = tiny_lm()
    ids = torch.randint(0, 23, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, :2] = False
    mask[2, 4:] = False
    for kw in (dict(), dict(attention_mask=mask)):
        paged = model.generate(ids, 5, page_size=4, **kw)
        assert torch.equal(paged, model.generate(ids, 5, paged=False, **kw))
    seq = ids
    with torch.no_grad():
        for _ in range(5):
            seq = torch.cat((seq, model(seq)[:, -1:].argmax(-1)), 1)
    assert torch.equal(model.generate(ids, 5, page_size=3), seq[:, 6:])
    # sampling: both caches draw the same noise from the generator
    runs = [model.generate(ids, 6, temperature=0.8, generator=torch.Generator().manual_seed(5), paged=p)
            for p in (True, False)]
    assert torch.equal(*runs)
    assert model.generate(ids, 0).shape == (3, 0)
    with pytest.raises(ValueError, match="cuda_graph=True needs CUDA"):
        model.generate(ids, 3, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph must be"):
        model.generate(ids, 3, cuda_graph="yes")


def test_paged_decoding_on_triton_kernels_matches_torch_backend():
    """backend="auto" on a CPU: the Triton flash_attn_with_kvcache and step kernels in the interpreter."""
    torch.manual_seed(3)
    ref = tiny_lm("KA", dtype=torch.float32)
    model = tiny_lm("KA", dtype=torch.float32, backend="auto")
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 23, (2, 5))
    with torch.no_grad():
        caches = [m.new_cache(max_seqlen=8, page_size=4) for m in (ref, model)]
        for lo, hi in ((0, 5), (5, 6), (6, 7)):
            tok = ids[:, lo:hi] if hi <= 5 else ids[:, :1]
            torch.testing.assert_close(model(tok, cache=caches[1]), ref(tok, cache=caches[0]), atol=2e-5, rtol=2e-5)


def test_decode_bench_example_runs_on_cpu_with_no_arguments():
    """examples/hybrid_decode.py with no arguments, as a new user runs it on a CPU machine (no Triton
    interpreter): tiny sizes, both models prefill, decode and print a row."""
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, str(root / "examples" / "hybrid_decode.py")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith(("hybrid", "attention"))]
    assert [r[:2] for r in rows] == [["hybrid", "KKKA"], ["attention", "A"]]
    assert all(float(r[3]) > 0 and r[4] == "-" for r in rows)   # eager tokens/s; no graph on a CPU
