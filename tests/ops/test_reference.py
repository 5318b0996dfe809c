"""The specification cross-checked against independent formulations, in float64 (<= 1e-10 relative)."""
import math

import pytest
import torch
import torch.nn.functional as F

from delta_attn import reference as ref

F64 = torch.float64
TOL = 1e-10


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def rand(*shape):
    return torch.randn(*shape, dtype=F64)


# ------------------------------------------------------------------ attention

def sdpa_explicit(q, k, v, scale, visible, bias=None):
    """Attention by SDPA's math path with an explicit boolean mask and additive bias."""
    hq, hk = q.shape[2], k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt = kt.repeat_interleave(hq // hk, 1)
    vt = vt.repeat_interleave(hq // hk, 1)
    mask = torch.zeros(visible.shape, dtype=F64).masked_fill(~visible, float("-inf"))
    if bias is not None:
        mask = mask + bias
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def naive_attention(q, k, v, scale, visible, softcap=0.0, slopes=None, keep=None, p=0.0):
    """Row by row, element by element (tiny sizes): scores, softcap, ALiBi, mask, softmax, dropout."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=F64)
    lse = torch.full((b, hq, sq), float("inf"), dtype=F64)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hk)
            for i in range(sq):
                js = [j for j in range(sk) if visible[i, j]]
                if not js:
                    continue
                s = []
                for j in js:
                    x = float(q[bi, i, h] @ k[bi, j, kh]) * scale
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    if slopes is not None:
                        x -= float(slopes[h]) * abs(i + sk - sq - j)
                    s.append(x)
                m = max(s)
                z = sum(math.exp(x - m) for x in s)
                lse[bi, h, i] = m + math.log(z)
                for j, x in zip(js, s):
                    w = math.exp(x - m) / z
                    if keep is not None:
                        w = w * float(keep[bi, h, i, j]) / (1 - p)
                    out[bi, i, h] += w * v[bi, j, kh]
    return out, lse


@pytest.mark.parametrize("sq,sk,hq,hk,causal,window", [
    (17, 17, 4, 4, False, (-1, -1)),
    (17, 33, 4, 1, True, (-1, -1)),      # bottom-right causal, Sq < Sk, MQA
    (33, 17, 8, 2, True, (-1, -1)),      # Sq > Sk: the first rows see no key
    (29, 29, 4, 4, False, (5, 3)),       # sliding window
    (13, 21, 4, 2, True, (4, -1)),       # causal + left window
])
def test_attention_matches_sdpa_with_explicit_mask(sq, sk, hq, hk, causal, window):
    q, k, v = rand(2, sq, hq, 24), rand(2, sk, hk, 24), rand(2, sk, hk, 24)
    out, lse = ref.attention(q, k, v, causal=causal, window_size=window)
    visible = ref.attention_mask(sq, sk, window, causal)
    want = sdpa_explicit(q, k, v, 24 ** -0.5, visible)
    rows = visible.any(-1)
    assert rel_err(out[:, rows], want[:, rows]) < TOL
    assert torch.equal(out[:, ~rows], torch.zeros_like(out[:, ~rows]))      # empty rows give zeros
    assert torch.isinf(lse[:, :, ~rows]).all() and (lse[:, :, ~rows] > 0).all()
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(hq // hk, 2)) * 24 ** -0.5
    want_lse = torch.logsumexp(s.masked_fill(~visible, float("-inf")), -1)
    assert rel_err(lse[:, :, rows], want_lse[:, :, rows]) < TOL


def test_attention_mask_semantics():
    # Sq=2, Sk=4, causal: query 0 sits at key 2 (bottom-right), so sees keys 0..2
    m = ref.attention_mask(2, 4, causal=True)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    m = ref.attention_mask(3, 3, window_size=(1, 0))
    assert m.tolist() == [[True, False, False], [True, True, False], [False, True, True]]


def test_attention_alibi_matches_sdpa_bias():
    sq, sk, h = 11, 19, 4
    q, k, v = rand(1, sq, h, 16), rand(1, sk, h, 16), rand(1, sk, h, 16)
    slopes = torch.rand(h, dtype=torch.float32)
    out, _ = ref.attention(q, k, v, alibi_slopes=slopes, causal=True)
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    bias = -slopes.to(F64).view(1, h, 1, 1) * (i + sk - sq - j).abs()
    want = sdpa_explicit(q, k, v, 16 ** -0.5, ref.attention_mask(sq, sk, causal=True), bias)
    assert rel_err(out, want) < TOL
    # per-batch slopes (B, H) index by batch
    q2, k2, v2 = (torch.cat([t, t]) for t in (q, k, v))
    out2, _ = ref.attention(q2, k2, v2, alibi_slopes=torch.stack([slopes, slopes * 0]), causal=True)
    assert rel_err(out2[:1], want) < TOL
    plain, _ = ref.attention(q, k, v, causal=True)
    assert rel_err(out2[1:], plain) < TOL


def test_attention_softcap_and_dropout_match_naive_loop():
    sq, sk, hq, hk = 7, 9, 4, 2
    q, k, v = rand(1, sq, hq, 8) * 3, rand(1, sk, hk, 8) * 3, rand(1, sk, hk, 8)
    slopes = torch.rand(hq, dtype=torch.float32)
    keep = torch.rand(1, hq, sq, sk) > 0.3
    visible = ref.attention_mask(sq, sk, (3, 1), False)
    out, lse = ref.attention(q, k, v, softcap=2.5, alibi_slopes=slopes, window_size=(3, 1), dropout_p=0.3,
                             dropout_mask=keep)
    want, want_lse = naive_attention(q, k, v, 8 ** -0.5, visible, softcap=2.5, slopes=slopes, keep=keep, p=0.3)
    assert rel_err(out, want) < TOL
    assert rel_err(lse, want_lse) < TOL


def test_attention_gradients_zero_and_finite_on_fully_masked_rows():
    q, k, v = (rand(1, 6, 2, 8).requires_grad_() for _ in range(3))
    out, _ = ref.attention(q, k[:, :3], v[:, :3], causal=True)   # Sq > Sk: rows 0..2 see no key
    out.pow(2).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:, :3], torch.zeros_like(q.grad[:, :3]))
    assert q.grad[:, 3:].abs().sum() > 0


def test_attention_varlen_equals_per_sequence_loop_and_layouts():
    lens_q, lens_k = [5, 0, 1, 9], [7, 3, 0, 9]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q, k, v = rand(sum(lens_q), 4, 16), rand(sum(lens_k), 2, 16), rand(sum(lens_k), 2, 16)
    slopes = torch.rand(4, 4)
    out, lse = ref.attention_varlen(q, k, v, cu_q, cu_k, causal=True, alibi_slopes=slopes)
    for i in range(4):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            assert torch.equal(out[q0:q1], torch.zeros_like(out[q0:q1]))
            assert torch.isinf(lse[:, q0:q1]).all()
            continue
        o_i, l_i = ref.attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True, alibi_slopes=slopes[i])
        assert rel_err(out[q0:q1], o_i[0]) < TOL
        assert torch.allclose(lse[:, q0:q1], l_i[0], rtol=TOL, atol=0)
    out_htd, lse_htd = ref.attention_varlen(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu_q, cu_k,
                                            causal=True, alibi_slopes=slopes, layout="htd")
    assert torch.equal(out_htd.transpose(0, 1), out) and torch.equal(lse_htd, lse)


# ------------------------------------------------------------------ KDA

def kda_matrix_form(q, k, v, g, beta, scale, s0=None):
    """S_t = (I - b k k^T) Diag(exp g) S_{t-1} + b k v^T, o_t = S_t^T (scale q) — per head, explicit."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    grp = hv // h
    o = torch.zeros(b, t, hv, vd, dtype=F64)
    finals = torch.zeros(b, hv, kd, vd, dtype=F64)
    eye = torch.eye(kd, dtype=F64)
    for bi in range(b):
        for hh in range(hv):
            S = torch.zeros(kd, vd, dtype=F64) if s0 is None else s0[bi, hh].clone()
            for ti in range(t):
                kk = k[bi, ti, hh // grp]
                bt = beta[bi, ti, hh]
                S = (eye - bt * torch.outer(kk, kk)) @ torch.diag(g[bi, ti, hh].exp()) @ S + bt * torch.outer(kk, v[bi, ti, hh])
                o[bi, ti, hh] = S.T @ (scale * q[bi, ti, hh // grp])
            finals[bi, hh] = S
    return o, finals


def kda_inputs(b, t, h, hv, kd, vd):
    q, k = rand(b, t, h, kd), ref.l2norm(rand(b, t, h, kd))
    return q, k, rand(b, t, hv, vd), -torch.rand(b, t, hv, kd, dtype=F64) * 2, torch.rand(b, t, hv, dtype=F64)


@pytest.mark.parametrize("h,hv", [(2, 2), (1, 3)])
def test_kda_matches_matrix_form(h, hv):
    q, k, v, g, beta = kda_inputs(2, 9, h, hv, 6, 5)
    s0 = rand(2, hv, 6, 5)
    o, fin = ref.kda(q, k, v, g, beta, scale=0.7, initial_state=s0, output_final_state=True)
    want_o, want_fin = kda_matrix_form(q, k, v, g, beta, 0.7, s0)
    assert rel_err(o, want_o) < TOL and rel_err(fin, want_fin) < TOL
    assert fin.dtype == F64


def test_kda_l2norm_and_gates_match_formulas():
    q, k, v, graw, beta = kda_inputs(1, 7, 2, 2, 4, 4)
    a_log, dt_bias = rand(2), rand(8)
    o, _ = ref.kda(q, k, v, graw, beta, use_qk_l2norm=True, A_log=a_log, dt_bias=dt_bias)
    gate = -a_log.exp().view(2, 1) * torch.log1p((graw + dt_bias.view(2, 4)).exp())     # softplus
    qn = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    kn = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    want, _ = kda_matrix_form(qn, kn, v, gate, beta, 4 ** -0.5)
    assert rel_err(o, want) < TOL
    o2, _ = ref.kda(q, k, v, graw, beta, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0)
    gate2 = -5.0 / (1 + (-(a_log.exp().view(2, 1) * (graw + dt_bias.view(2, 4)))).exp())
    want2, _ = kda_matrix_form(q, k, v, gate2, beta, 4 ** -0.5)
    assert rel_err(o2, want2) < TOL


def test_kda_varlen_equals_per_sequence_and_handles_extreme_decay():
    lens = [4, 0, 1, 6]
    cu = torch.tensor([0, 4, 4, 5, 11], dtype=torch.int32)
    q, k, v, g, beta = kda_inputs(1, 11, 2, 2, 4, 3)
    g[0, 2] = -1e4
    g[0, 7, 0] = float("-inf")     # -inf is a reset
    s0 = rand(4, 2, 4, 3)
    o, fin = ref.kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    assert torch.isfinite(o).all() and torch.isfinite(fin).all()
    for i in range(4):
        a, b_ = int(cu[i]), int(cu[i + 1])
        o_i, f_i = kda_matrix_form(q[:, a:b_], k[:, a:b_], v[:, a:b_], g[:, a:b_], beta[:, a:b_], 4 ** -0.5, s0[i:i + 1])
        if b_ > a:
            assert rel_err(o[:, a:b_], o_i) < TOL
        assert rel_err(fin[i], f_i[0]) < TOL
    assert torch.equal(fin[1], s0[1])     # zero-length sequence: state passes through


# ------------------------------------------------------------------ gated diagonal

def diag_closed_form(q, k, v, g, s0):
    """s_t = exp(G_t) s0 + sum_{j<=t} exp(G_t - G_j) k_j v_j with G = cumsum(g)."""
    G = g.cumsum(1)
    t = q.shape[1]
    decay = (G[:, :, None] - G[:, None, :])                     # (B, t, j, H, D)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, :, :, None, None]
    w = torch.where(causal, decay.exp(), torch.zeros_like(decay))
    s = torch.einsum("btjhd,bjhd->bthd", w, k * v) + G.exp() * s0[:, None]
    return q * s, s[:, -1]


def test_gated_diag_matches_closed_form():
    q, k, v = rand(2, 13, 3, 5), rand(2, 13, 3, 5), rand(2, 13, 3, 5)
    g = -torch.rand(2, 13, 3, 5, dtype=F64)
    s0 = rand(2, 3, 5)
    o, fin = ref.gated_diag(q, k, v, g, initial_state=s0, output_final_state=True)
    want_o, want_fin = diag_closed_form(q, k, v, g, s0)
    assert rel_err(o, want_o) < TOL and rel_err(fin, want_fin) < TOL


def test_gated_diag_varlen_and_decay_floor():
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    q, k, v = rand(1, 10, 2, 4), rand(1, 10, 2, 4), rand(1, 10, 2, 4)
    g = -torch.rand(1, 10, 2, 4, dtype=F64)
    g[0, 5] = -1e4
    s0 = rand(3, 2, 4)
    o, fin = ref.gated_diag(q, k, v, g, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    assert torch.isfinite(o).all()
    for i in range(3):
        a, b_ = int(cu[i]), int(cu[i + 1])
        if b_ == a:
            assert torch.equal(fin[i], s0[i])
            continue
        o_i, f_i = diag_closed_form(q[:, a:b_], k[:, a:b_], v[:, a:b_], g[:, a:b_], s0[i:i + 1])
        assert rel_err(o[:, a:b_], o_i) < TOL and rel_err(fin[i], f_i[0]) < TOL


def test_upcast_false_computes_in_input_precision():
    q, k, v = (torch.randn(1, 33, 2, 32, dtype=torch.float16) for _ in range(3))
    o32, _ = ref.attention(q, k, v)
    o16, _ = ref.attention(q, k, v, upcast=False)
    o64, _ = ref.attention(q.double(), k.double(), v.double())
    e32 = float((o32.double() - o64).abs().max())
    e16 = float((o16.double() - o64).abs().max())
    assert o16.dtype == torch.float16 and e16 >= e32
