"""delta_attn as a Hugging Face transformers ``attn_implementation``: same outputs as ``sdpa``.

Tiny Llama / Qwen2 models built from local configs (no download), float64 so that the two
implementations must agree to ~1e-12.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from delta_attn.integrations.transformers import register  # noqa: E402

NAME = register("delta_attn_test_torch", backend="torch")
TOL = dict(atol=1e-10, rtol=1e-10)


def tiny(family: str, dtype=torch.float64, **extra):
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **extra)
    cfg = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = (LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM)(cfg)
    return model.to(dtype).eval()


def both(model, fn, name=NAME):
    """fn(model) with sdpa, then with delta_attn."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = fn(model)
    model.set_attn_implementation(name)
    assert model.config._attn_implementation == name
    with torch.no_grad():
        out = fn(model)
    return ref, out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_same_logits_as_sdpa_dense_and_padded(family):
    model = tiny(family)
    ids = torch.randint(0, 61, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[0, :4] = 0          # left padding
    mask[2, 8:] = 0          # right padding
    ref, out = both(model, lambda m: (m(ids).logits, m(ids, attention_mask=mask).logits))
    torch.testing.assert_close(out[0], ref[0], **TOL)
    real = mask.bool()
    torch.testing.assert_close(out[1][real], ref[1][real], **TOL)


@pytest.mark.parametrize("family,cache", [("llama", "dynamic"), ("qwen2", "dynamic"), ("llama", "static")])
def test_same_greedy_generation_with_kv_cache_as_sdpa(family, cache):
    model = tiny(family)
    ids = torch.randint(0, 61, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    gen = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
               attention_mask=mask, pad_token_id=0, cache_implementation=cache)
    ref, out = both(model, lambda m: m.generate(ids, **gen))
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), **TOL)


def test_packed_sequences_from_position_ids_match_separate_runs():
    model = tiny("llama")
    model.set_attn_implementation(NAME)
    ids = torch.randint(0, 61, (1, 10))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]])
    with torch.no_grad():
        packed = model(ids, position_ids=pos).logits
        parts = [model(ids[:, a:b]).logits for a, b in ((0, 4), (4, 6), (6, 10))]
    torch.testing.assert_close(packed, torch.cat(parts, 1), **TOL)


def test_sliding_window_matches_sdpa():
    model = tiny("qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=0)
    assert "sliding_attention" in model.config.layer_types
    ids = torch.randint(0, 61, (2, 9))
    ref, out = both(model, lambda m: m(ids).logits)
    torch.testing.assert_close(out, ref, **TOL)
    # the window is really applied: without it the logits differ
    full = tiny("qwen2")
    full.load_state_dict(model.state_dict())
    full.set_attn_implementation(NAME)
    with torch.no_grad():
        assert not torch.allclose(full(ids).logits, out)


def test_default_registration_auto_backend_float32():
    name = register()
    assert name == "delta_attn"
    model = tiny("llama", dtype=torch.float32)
    ids = torch.randint(0, 61, (2, 6))
    ref, out = both(model, lambda m: m(ids).logits, name=name)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # training: gradients flow through the registered attention
    model.train()
    model(ids, labels=ids).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_unsupported_requests_raise_clear_errors():
    from delta_attn.integrations.transformers import make_attention_forward
    fn = make_attention_forward("torch")
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="2-D padding mask"):
        fn(module, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="output_attentions"):
        fn(module, q, q, q, None, output_attentions=True)


def test_single_query_is_always_real_and_static_cache_keys_are_sliced():
    """As transformers' flash path: one query attends the real keys even when the mask's last slot
    is 0, and keys beyond the mask's length (unfilled static-cache slots) are ignored."""
    from delta_attn.integrations.transformers import make_attention_forward
    fn = make_attention_forward("torch")
    module = torch.nn.Module()
    q = torch.randn(2, 4, 1, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 6, 8, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 1], [0, 1, 1, 1, 0]])          # 5 < 6 keys: slot 5 is unfilled
    out, _ = fn(module, q, k, v, mask)
    for b in range(2):
        real = mask[b].bool().nonzero().view(-1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1], k[b:b + 1, :, real].repeat_interleave(2, 1), v[b:b + 1, :, real].repeat_interleave(2, 1))
        torch.testing.assert_close(out[b], ref[0].transpose(0, 1), **TOL)
