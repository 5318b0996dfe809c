"""The public API on backend="torch": signatures, return forms, autograd, decode, structural identities."""
import torch

import delta_attn as da
from delta_attn import reference as ref


def test_flash_attn_func_positional_order_and_lse():
    q, k, v = torch.randn(2, 9, 4, 16), torch.randn(2, 11, 2, 16), torch.randn(2, 11, 2, 16)
    # flash-attn 2 positional order: dropout_p, softmax_scale, causal, window_size, softcap, alibi, deterministic, probs
    out, lse, probs = da.flash_attn_func(q, k, v, 0.0, 0.3, True, (-1, -1), 0.0, None, False, True, backend="torch")
    want, want_lse = ref.attention(q, k, v, softmax_scale=0.3, causal=True)
    assert probs is None and out.shape == (2, 9, 4, 16) and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert torch.allclose(out, want) and torch.allclose(lse, want_lse)


def test_dropout_follows_torch_manual_seed():
    q = torch.randn(1, 8, 2, 16)
    torch.manual_seed(3)
    a = da.flash_attn_func(q, q, q, dropout_p=0.5, backend="torch")
    torch.manual_seed(3)
    b = da.flash_attn_func(q, q, q, dropout_p=0.5, backend="torch")
    c = da.flash_attn_func(q, q, q, dropout_p=0.5, backend="torch")
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_varlen_both_layouts_and_autograd():
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    q, k, v = (torch.randn(10, 4, 8, requires_grad=True) for _ in range(3))
    out, lse, _ = da.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, return_attn_probs=True, backend="torch")
    out2 = da.flash_attn_varlen_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu, cu, 7, 7,
                                     causal=True, layout="htd", backend="torch")
    assert lse.shape == (4, 10) and torch.allclose(out2.transpose(0, 1), out)
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_kda_gradients_reach_every_input():
    q, k = torch.randn(1, 6, 1, 4, requires_grad=True), torch.randn(1, 6, 1, 4, requires_grad=True)
    v, g = torch.randn(1, 6, 2, 4, requires_grad=True), torch.randn(1, 6, 2, 4, requires_grad=True)
    beta, s0 = torch.rand(1, 6, 2, requires_grad=True), torch.randn(1, 2, 4, 4, requires_grad=True)
    a_log, dt_bias = torch.randn(2, requires_grad=True), torch.randn(8, requires_grad=True)
    o, s = da.kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True, A_log=a_log,
                  dt_bias=dt_bias, backend="torch")
    (o.sum() + s.sum()).backward()
    for t in (q, k, v, g, beta, s0, a_log, dt_bias):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def kda_inputs(t):
    q, k = torch.randn(2, t, 2, 8, dtype=torch.float64), torch.randn(2, t, 2, 8, dtype=torch.float64)
    v, g = torch.randn(2, t, 4, 8, dtype=torch.float64), -torch.rand(2, t, 4, 8, dtype=torch.float64)
    return q, k, v, g, torch.rand(2, t, 4, dtype=torch.float64)


def test_kda_two_halves_and_token_by_token_decode_equal_one_pass():
    q, k, v, g, beta = kda_inputs(11)
    o, s = da.kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True, backend="torch")
    o1, s1 = da.kda(*(t[:, :5] for t in (q, k, v, g, beta)), output_final_state=True, use_qk_l2norm=True, backend="torch")
    o2, s2 = da.kda(*(t[:, 5:] for t in (q, k, v, g, beta)), initial_state=s1, output_final_state=True,
                    use_qk_l2norm=True, backend="torch")
    assert torch.allclose(torch.cat([o1, o2], 1), o, atol=1e-12) and torch.allclose(s2, s, atol=1e-12)
    # prefill 5 tokens, then decode the rest from a pool with shuffled slots
    pool = torch.zeros(5, 4, 8, 8, dtype=torch.float64)
    slots = torch.tensor([3, 1])
    pool[slots] = s1
    outs = [da.kda_step(*(t[:, i:i + 1] for t in (q, k, v, g, beta)), pool, state_indices=slots,
                        use_qk_l2norm=True, backend="torch") for i in range(5, 11)]
    assert torch.allclose(torch.cat(outs, 1), o[:, 5:], atol=1e-12)
    assert torch.allclose(pool[slots], s, atol=1e-12)
    assert torch.equal(pool[0], torch.zeros_like(pool[0]))     # untouched slots stay


def test_gated_diag_halves_and_decode_equal_one_pass():
    q, k, v = (torch.randn(2, 9, 3, 4, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(2, 9, 3, 4, dtype=torch.float64)
    o, s = da.gated_diag_attn(q, k, v, g, output_final_state=True, backend="torch")
    _, s1 = da.gated_diag_attn(q[:, :4], k[:, :4], v[:, :4], g[:, :4], output_final_state=True, backend="torch")
    state = s1.clone()
    o_dec = da.gated_diag_step(q[:, 4:], k[:, 4:], v[:, 4:], g[:, 4:], state, backend="torch")
    assert torch.allclose(o_dec, o[:, 4:], atol=1e-12) and torch.allclose(state, s, atol=1e-12)


def test_decode_is_inference_only():
    import pytest
    q = torch.randn(1, 1, 2, 4, requires_grad=True)
    g = -q.abs()                                            # a log decay (<= 0)
    with pytest.raises(da.UnsupportedError, match="no backward pass"):
        da.gated_diag_step(q, q, q, g, torch.zeros(1, 2, 4), backend="torch")
    with torch.no_grad():
        da.gated_diag_step(q, q, q, g, torch.zeros(1, 2, 4), backend="torch")


def test_dispatch_traces_under_torch_compile_fullgraph():
    """Validation and backend choice run at trace time: no graph break from the public wrappers."""
    def f(q, k, v, g):
        a = da.flash_attn_func(q, k, v, causal=True, backend="torch")
        b = da.gated_diag_attn(q, k, v, g, backend="torch")[0]
        return a + b
    x = torch.randn(1, 8, 2, 16)
    g = -torch.rand(1, 8, 2, 16)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.allclose(compiled(x, x, x, g), f(x, x, x, g))
