"""GPU tests of the layers and the hybrid model on backend="auto" (the Triton / cuDNN kernels), bf16.

Each layer runs in bf16 on the kernels and, with the same weights, in float64 on the ``torch``
backend (the ground truth) and in bf16 on the ``torch`` backend (the baseline error of bf16
projections): the kernels' error must stay within ``FACTOR`` x the baseline plus a floor. Checked for
full forwards, padded and varlen batches, and decoding from caches (prefill + step kernels).
"""
import copy

import pytest
import torch

import delta_attn.nn as dnn

DT = torch.bfloat16
DEVICE = "cuda"
COMPILE_BACKEND = "inductor"
FACTOR = 4.0
KINDS = ["attention", "kda", "diag"]


def build(kind: str, hidden: int = 128):
    if kind == "attention":
        return dnn.MultiheadAttention(hidden, num_heads=4, num_kv_heads=2, backend="auto")
    if kind == "kda":
        return dnn.KimiDeltaAttention(hidden, num_heads=2, head_dim=64, backend="auto")
    return dnn.GatedDiagonalAttention(hidden, num_heads=2, head_dim=64, backend="auto")


def triple(layer: torch.nn.Module, device):
    """(kernels bf16, torch float64, torch bf16) copies of one layer."""
    out = []
    for dtype, backend in ((DT, "auto"), (torch.float64, "torch"), (DT, "torch")):
        m = copy.deepcopy(layer).to(device=device, dtype=dtype).eval()
        for mod in m.modules():
            if hasattr(mod, "backend"):
                mod.backend = backend
        out.append(m)
    return out


def assert_within(out, ref64, ref_lowp, what):
    out, ref64, ref_lowp = (t.detach().double() for t in (out, ref64, ref_lowp))
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = float((out - ref64).abs().max())
    base = float((ref_lowp - ref64).abs().max())
    bound = FACTOR * base + 1e-3 * max(1.0, float(ref64.abs().max()))
    assert err <= bound, f"{what}: error {err:.3e} > {bound:.3e} (bf16 torch-backend error {base:.3e})"


def decode(layer, kind, x, mask, prefill):
    cache = dnn.KVCache() if kind == "attention" else dnn.RecurrentCache()
    with torch.no_grad():
        outs = [layer(x[:, :prefill], attention_mask=None if mask is None else mask[:, :prefill], cache=cache)]
        outs += [layer(x[:, t:t + 1], cache=cache) for t in range(prefill, x.shape[1])]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_kernels_full_padded_varlen_and_decode(kind):
    dev = torch.device(DEVICE)
    torch.manual_seed(0)
    kern, r64, rlo = triple(build(kind), dev)
    x = torch.randn(3, 77, 128, device=dev)
    mask = torch.ones(3, 77, dtype=torch.bool, device=dev)
    mask[0, :20] = False
    mask[2, 50:] = False
    cu = torch.tensor([0, 33, 33, 34, 100], dtype=torch.int32, device=dev)
    xv = torch.randn(1, 100, 128, device=dev)
    with torch.no_grad():
        outs = [(m(x.to(d)), m(x.to(d), attention_mask=mask), m(xv.to(d), cu_seqlens=cu))
                for m, d in ((kern, DT), (r64, torch.float64), (rlo, DT))]
    for i, what in enumerate(("dense", "padded", "varlen")):
        a, b, c = (o[i] for o in outs)
        if what == "padded":
            a, b, c = a[mask], b[mask], c[mask]
        assert_within(a, b, c, f"{kind} {what}")
    full64 = outs[1][0]
    assert_within(decode(kern, kind, x.to(DT), None, 70), full64, decode(rlo, kind, x.to(DT), None, 70),
                  f"{kind} decode")
    pad64 = outs[1][1]
    dk = decode(kern, kind, x.to(DT), mask, 60)
    dl = decode(rlo, kind, x.to(DT), mask, 60)
    assert_within(dk[mask], pad64[mask], dl[mask], f"{kind} padded decode")
    # training: gradients reach every parameter, finite
    kern.train()
    kern(x.to(DT), attention_mask=mask).float().square().mean().backward()
    for name, p in kern.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_hybrid_model_compiles_and_generates_on_gpu():
    dev = torch.device(DEVICE)
    torch.manual_seed(0)
    model = dnn.HybridLM(dnn.HybridConfig(vocab_size=97, hidden_size=128, num_layers=4, num_heads=2,
                                          head_dim=64, num_kv_heads=1, backend="auto")).to(dev, DT)
    ids = torch.randint(0, 97, (2, 65), device=dev)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=COMPILE_BACKEND)
    out = compiled(ids)
    ref = model(ids)
    # inductor fuses the bf16 elementwise ops differently: a loose bound that still catches garbage
    torch.testing.assert_close(out.float(), ref.float(), atol=0.1, rtol=0.05)
    out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    gen = model.generate(ids[:, :40], max_new_tokens=8)
    assert gen.shape == (2, 8)


def test_transformers_integration_matches_sdpa_on_gpu():
    transformers = pytest.importorskip("transformers")
    from delta_attn.integrations.transformers import register
    name = register()
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DEVICE, DT).eval()
    ids = torch.randint(0, 101, (2, 97), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :30] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(name)
        out = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")   # float32 as the ground truth (HF's eager mask overflows in float64)
        model.float()
        r64 = model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert_within(out[real], r64[real], ref[real], "llama logits (sdpa bf16 as the baseline)")
