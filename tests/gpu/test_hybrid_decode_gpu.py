"""GPU: HybridLM.generate with the paged KV cache and a captured CUDA-graph decode step (backend "auto").

Greedy tokens of the graph path must equal the eager paged path (the same kernels on the same buffers:
bitwise equal logits), and the eager paged path must equal the growing KVCache path (fp32, where near
ties are rare; also checked on the logits of a step). The replays run under
``torch.cuda.set_sync_debug_mode("error")``: a host synchronisation in the captured step would raise.
"""
import pytest
import torch

import delta_attn.nn as dnn

DEVICE = "cuda"


def model(pattern: str, dtype) -> dnn.HybridLM:
    torch.manual_seed(0)
    cfg = dnn.HybridConfig(vocab_size=257, hidden_size=128, num_layers=4, num_heads=2, head_dim=64,
                           num_kv_heads=1, pattern=pattern, backend="auto")
    return dnn.HybridLM(cfg).to(DEVICE, dtype).eval()


@pytest.mark.parametrize("pattern", ["KKKA", "KDKA", "A"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_decode_equals_eager_and_growing_cache(pattern, dtype):
    m = model(pattern, dtype)
    ids = torch.randint(0, 257, (3, 77), device=DEVICE)
    graph = m.generate(ids, 24, page_size=16, cuda_graph=True)
    eager = m.generate(ids, 24, page_size=16, cuda_graph=False)
    assert torch.equal(graph, eager)
    if dtype == torch.float32:
        assert torch.equal(eager, m.generate(ids, 24, paged=False))
    # padded prompts and sampling take the graph path too
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :10] = False
    mask[2, 60:] = False
    kw = dict(attention_mask=mask, temperature=0.7, page_size=16)
    runs = [m.generate(ids, 12, generator=torch.Generator(DEVICE).manual_seed(3), cuda_graph=g, **kw)
            for g in (True, False)]
    assert torch.equal(*runs)


def test_paged_step_logits_match_growing_cache():
    m = model("KKKA", torch.float32)
    ids = torch.randint(0, 257, (2, 300), device=DEVICE)
    with torch.no_grad():
        paged, grow = m.new_cache(max_seqlen=310, page_size=64), m.new_cache()
        torch.testing.assert_close(m(ids, cache=paged), m(ids, cache=grow), atol=1e-4, rtol=1e-4)
        tok = ids[:, -1:]
        for _ in range(4):
            a, b = m(tok, cache=paged), m(tok, cache=grow)
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            tok = b[:, -1:].argmax(-1)


def test_captured_step_does_not_synchronise():
    m = model("KKKA", torch.bfloat16)
    ids = torch.randint(0, 257, (2, 33), device=DEVICE)
    ref = m.generate(ids, 10, page_size=16, cuda_graph=False)
    try:
        cache = m.new_cache(max_seqlen=43, page_size=16)
        with torch.no_grad():                                # the eager prefill / warm-up check values (syncs)
            tok = m(ids, cache=cache)[:, -1:].argmax(-1)
            out = [tok, m._graph_warmup(lambda t: m(t, cache=cache)[:, -1], tok).argmax(-1, keepdim=True)]
            cache.reserve(8)                                  # host page allocation (a copy) before capture
            torch.cuda.set_sync_debug_mode("error")
            out += m._graph_decode(lambda t: m(t, cache=cache)[:, -1], cache, out[-1], 8, 0.0, None, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(torch.cat(out, 1), ref)
