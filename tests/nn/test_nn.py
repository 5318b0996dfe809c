"""Layers (delta_attn.nn): caches, padded and varlen batches, gradients, torch.compile, the hybrid LM.

Layers run in float64 on the ``torch`` backend, so every identity below (cached decoding == one
full forward, padded == unpadded, varlen == per-sequence) must hold to ~1e-12.
"""
import pytest
import torch

import delta_attn.nn as dnn

DT = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)
C = 24


def make(kind: str) -> torch.nn.Module:
    if kind == "attention":
        layer = dnn.MultiheadAttention(C, num_heads=4, num_kv_heads=2, head_dim=6, backend="torch")
    elif kind == "kda":   # grouped value heads (HV = 2 H), K != V
        layer = dnn.KimiDeltaAttention(C, num_heads=2, head_dim=6, num_v_heads=4, head_v_dim=5, backend="torch")
    else:
        layer = dnn.GatedDiagonalAttention(C, num_heads=3, backend="torch")
    return layer.to(DT).eval()


def new_cache(kind: str):
    return dnn.KVCache() if kind == "attention" else dnn.RecurrentCache()


KINDS = ["attention", "kda", "diag"]


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_decoding_matches_full_forward(kind):
    layer = make(kind)
    x = torch.randn(2, 9, C, dtype=DT)
    with torch.no_grad():
        full = layer(x)
        cache = new_cache(kind)
        # prefill 4, a chunk of 2 (the step kernels take a few tokens), then token by token
        outs = [layer(x[:, :4], cache=cache), layer(x[:, 4:6], cache=cache)]
        outs += [layer(x[:, t:t + 1], cache=cache) for t in range(6, 9)]
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)
    # with grad enabled the linear layers continue through the chunked op (initial_state), not the step
    cache = new_cache(kind)
    with torch.no_grad():
        layer(x[:, :5], cache=cache)
    torch.testing.assert_close(layer(x[:, 5:], cache=cache).detach(), full[:, 5:], **TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_batch_matches_unpadded_and_decodes_from_cache(kind):
    layer = make(kind)
    lengths, t = [3, 7, 5], 7
    x = torch.randn(3, t, C, dtype=DT)
    mask = torch.zeros(3, t, dtype=torch.bool)
    mask[0, 4:] = True            # left padding
    mask[1, :] = True
    mask[2, :5] = True            # right padding
    xp = torch.where(mask[..., None], x, torch.full_like(x, 1e3))   # garbage in the padding
    extra = torch.randn(3, 3, C, dtype=DT)
    with torch.no_grad():
        out = layer(xp, attention_mask=mask)
        assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
        cache = new_cache(kind)
        layer(xp, attention_mask=mask, cache=cache)
        steps = torch.cat([layer(extra[:, i:i + 1], cache=cache) for i in range(3)], 1)
        for b in range(3):
            real = x[b:b + 1][:, mask[b]]
            assert real.shape[1] == lengths[b]
            torch.testing.assert_close(out[b][mask[b]], layer(real)[0], **TOL)
            ref = layer(torch.cat((real, extra[b:b + 1]), 1))[0, lengths[b]:]
            torch.testing.assert_close(steps[b], ref, **TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_varlen_matches_per_sequence_and_decodes_from_cache(kind):
    layer = make(kind)
    lens = [5, 0, 1, 6]
    cu = torch.tensor([0, 5, 5, 6, 12], dtype=torch.int32)
    x = torch.randn(1, 12, C, dtype=DT)
    extra = torch.randn(4, 2, C, dtype=DT)
    with torch.no_grad():
        out = layer(x, cu_seqlens=cu)
        cache = new_cache(kind)
        layer(x, cu_seqlens=cu, max_seqlen=6, cache=cache)
        steps = torch.cat([layer(extra[:, i:i + 1], cache=cache) for i in range(2)], 1)
        for n, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            seq = x[:, s0:s1]
            if lens[n]:
                torch.testing.assert_close(out[:, s0:s1], layer(seq), **TOL)
            ref = layer(torch.cat((seq, extra[n:n + 1]), 1))[0, lens[n]:]
            torch.testing.assert_close(steps[n], ref, **TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_every_parameter(kind):
    layer = make(kind).train()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    x = torch.randn(2, 6, C, dtype=DT)
    loss = layer(x, attention_mask=mask).square().sum()
    loss = loss + layer(torch.randn(1, 7, C, dtype=DT), cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32)).sum()
    loss.backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_kda_gate_and_step_paths_agree_in_float32():
    """float32 layer: cached decoding (kda_step) vs the chunked op, at float32 precision."""
    layer = dnn.KimiDeltaAttention(32, num_heads=2, backend="torch").eval()
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        full = layer(x)
        cache = dnn.RecurrentCache()
        outs = [layer(x[:, :2], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(2, 6)]
    assert cache.state.dtype == torch.float32 and cache.state.shape == (2, 2, 16, 16)
    assert cache.conv_state.shape == (2, 3, 3 * 32)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_rotary_positions_count_real_tokens_only():
    """Left padding must not shift rotary positions: same output as the unpadded sequence."""
    layer = dnn.MultiheadAttention(C, num_heads=2, backend="torch").to(DT)
    x = torch.randn(1, 4, C, dtype=DT)
    padded = torch.cat((torch.zeros(1, 3, C, dtype=DT), x), 1)
    mask = torch.tensor([[False] * 3 + [True] * 4])
    torch.testing.assert_close(layer(padded, attention_mask=mask)[:, 3:], layer(x), **TOL)
    # and rotary is really on: shifting the start changes the output of a non-rotary-invariant query
    no_rope = dnn.MultiheadAttention(C, num_heads=2, rotary=False, backend="torch").to(DT)
    no_rope.load_state_dict(layer.state_dict())
    assert not torch.allclose(no_rope(x), layer(x))


def test_gqa_cross_attention_memory_mask_and_cache():
    xattn = dnn.GQACrossAttention(C, num_heads=4, num_kv_heads=2, memory_size=10, backend="torch").to(DT)
    x = torch.randn(2, 5, C, dtype=DT)
    mem = torch.randn(2, 6, 10, dtype=DT)
    mmask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out = xattn(x, mem, memory_mask=mmask)
    torch.testing.assert_close(out[0], xattn(x[:1], mem[:1, :3])[0], **TOL)
    torch.testing.assert_close(out[1], xattn(x[1:], mem[1:])[0], **TOL)
    # queries see every memory entry (not causal): the first query depends on the last memory entry
    mem2 = mem.clone()
    mem2[1, -1] += 1
    assert not torch.allclose(xattn(x, mem2)[1, 0], xattn(x, mem)[1, 0])
    cache = dnn.CrossAttentionCache()
    first = xattn(x[:, :2], mem, memory_mask=mmask, cache=cache)
    rest = xattn(x[:, 2:], cache=cache)
    torch.testing.assert_close(torch.cat((first, rest), 1), out, **TOL)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in xattn.parameters())


def test_layers_reject_bad_layouts():
    layer = make("kda")
    with pytest.raises(ValueError, match="B == 1"):
        layer(torch.randn(2, 4, C, dtype=DT), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(torch.randn(2, 4, C, dtype=DT), attention_mask=torch.ones(2, 5, dtype=torch.bool))
    cache = dnn.RecurrentCache()
    with torch.no_grad():
        layer(torch.randn(2, 3, C, dtype=DT), cache=cache)
        with pytest.raises(ValueError, match="cache holds 2 sequences"):
            layer(torch.randn(3, 1, C, dtype=DT), cache=cache)


# ---------------------------------------------------------------------------------------------
# the hybrid model
# ---------------------------------------------------------------------------------------------

def tiny_lm(pattern="KDKA", dtype=DT, **kw):
    cfg = dnn.HybridConfig(vocab_size=23, hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1,
                           pattern=pattern, backend="torch", **kw)
    return dnn.HybridLM(cfg).to(dtype)


def test_hybrid_layer_pattern():
    assert dnn.HybridConfig(num_layers=8).layer_types() == ["kda", "kda", "kda", "attention"] * 2
    assert tiny_lm("KDKA").config.layer_types() == ["kda", "diag", "kda", "attention"]
    with pytest.raises(ValueError, match="pattern"):
        dnn.HybridConfig(pattern="KX").layer_types()


def test_hybrid_generate_with_caches_equals_recomputation_and_padding():
    model = tiny_lm().eval()
    ids = torch.randint(0, 23, (3, 6))
    new = model.generate(ids, max_new_tokens=4)
    seq = ids
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat((seq, model(seq)[:, -1:].argmax(-1)), 1)
    assert torch.equal(new, seq[:, 6:])
    # left- and right-padded prompts generate what the unpadded prompts generate
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, :2] = False
    mask[2, 4:] = False
    padded = ids.masked_fill(~mask, 0)
    gen = model.generate(padded, max_new_tokens=3, attention_mask=mask)
    for b in range(3):
        assert torch.equal(gen[b], model.generate(ids[b:b + 1][:, mask[b]], max_new_tokens=3)[0])


def test_hybrid_gradients_reach_every_parameter():
    model = tiny_lm().train()
    ids = torch.randint(0, 23, (2, 5))
    torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_hybrid_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) traces the whole model (all three layer types, the public ops
    and their dispatch): a graph break would raise. The "eager" compiler backend keeps it fast on CPU."""
    torch._dynamo.reset()
    model = tiny_lm(dtype=torch.float32)
    ids = torch.randint(0, 23, (2, 5))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    out = compiled(ids)
    torch.testing.assert_close(out, model(ids), atol=1e-6, rtol=1e-6)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # decoding from the caches (dataclasses updated in place, kda_step / gated_diag_step) compiles too
    with torch.no_grad():
        eager_cache, compiled_cache = model.new_cache(), model.new_cache()
        model(ids, cache=eager_cache)
        compiled(ids, cache=compiled_cache)
        nxt = ids[:, -1:]
        for _ in range(2):
            ref = model(nxt, cache=eager_cache)
            torch.testing.assert_close(compiled(nxt, cache=compiled_cache), ref, atol=1e-6, rtol=1e-6)
            nxt = ref[:, -1:].argmax(-1)


# ---------------------------------------------------------------------------------------------
# backend="auto": the kernels other backends provide (the Triton interpreter on a CPU machine)
# ---------------------------------------------------------------------------------------------

def _pair(kind, seed=1):
    """The same layer (same weights) on backend "torch" and "auto", float32."""
    def build(be):
        torch.manual_seed(seed)
        if kind == "attention":
            return dnn.MultiheadAttention(32, num_heads=4, num_kv_heads=2, backend=be).eval()
        if kind == "kda":
            return dnn.KimiDeltaAttention(32, num_heads=2, backend=be).eval()
        return dnn.GatedDiagonalAttention(32, num_heads=2, backend=be).eval()
    return build("torch"), build("auto")


@pytest.mark.parametrize("kind", KINDS)
def test_auto_backend_layers_match_torch_backend(kind):
    ref, layer = _pair(kind)
    x = torch.randn(2, 7, 32)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :3] = False
    with torch.no_grad():
        full = layer(x, attention_mask=mask)
        torch.testing.assert_close(full[mask], ref(x, attention_mask=mask)[mask], atol=2e-5, rtol=2e-5)
        cache = new_cache(kind)
        outs = [layer(x[:, :4], attention_mask=mask[:, :4], cache=cache)]
        outs += [layer(x[:, t:t + 1], cache=cache) for t in range(4, 7)]
    torch.testing.assert_close(torch.cat(outs, 1)[mask], full[mask], atol=2e-5, rtol=2e-5)


def test_auto_backend_hybrid_compiles_without_graph_breaks(monkeypatch):
    """Also with nothing imported yet: dispatch imports each implementation while the trace runs
    (kda and diag from one backend in one graph), and select() must see the later ones."""
    import types
    from delta_attn.backends import BACKENDS
    for b in BACKENDS.values():
        monkeypatch.setattr(b, "_loaded", {})
        monkeypatch.setattr(b, "loaded", types.SimpleNamespace(), raising=False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = dnn.HybridLM(dnn.HybridConfig(vocab_size=23, hidden_size=32, num_layers=4, num_heads=2,
                                          num_kv_heads=1, pattern="KDKA", backend="auto"))
    ids = torch.randint(0, 23, (2, 5))
    out = torch.compile(model, fullgraph=True, backend="eager")(ids)
    torch.testing.assert_close(out, model(ids), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
