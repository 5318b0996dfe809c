"""GPU tests of backend="cudnn" and backend="sdpa" against the float64 reference (bf16, odd sizes).

Dense (SDPA cuDNN route and cudnn-frontend graph route), varlen "thd" and "htd" with zero-length
sequences, Sq != Sk (causal rows that see nothing), GQA, windows; outputs, LSE and gradients,
with outputs poisoned. Frontend cases are skipped when nvidia-cudnn-frontend is missing.
"""
import pytest
import torch

import delta_attn as da
from delta_attn import reference
from delta_attn.backends import package_available
from delta_attn.testing import check, poison_outputs

DT = torch.bfloat16
needs_frontend = pytest.mark.skipif(not package_available("cudnn"), reason="nvidia-cudnn-frontend not installed")


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _compare(out, lse, leaves, ref_fn, dout):
    """out/lse of the backend vs ref_fn(upcast) on float64 and on the input dtype; then gradients."""
    r64 = [t.detach().double().requires_grad_() for t in leaves]
    rlo = [_leaf(t) for t in leaves]
    o64, l64 = ref_fn(*r64, upcast=True)
    olo, llo = ref_fn(*rlo, upcast=False)
    msgs = []
    for name, a, b64, blo, kind in (("out", out, o64, olo, "fwd"), ("lse", lse, l64, llo, "fwd")):
        v = check(a, b64, blo, kind=kind, name=name)
        msgs.append(v)
    out.backward(dout)
    o64.backward(dout.double())
    olo.backward(dout)
    for name, t, t64, tlo in zip("qkv", leaves, r64, rlo):
        msgs.append(check(t.grad, t64.grad, tlo.grad, kind="grad", name=f"d{name}"))
    bad = [m.message for m in msgs if not m.ok]
    assert not bad, "; ".join(bad)


def _dense(backend, b, sq, sk, hq, hk, d, causal, window=(-1, -1)):
    torch.manual_seed(0)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=DT, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=DT, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=DT, requires_grad=True)
    with poison_outputs():
        out, lse, _ = da.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True,
                                         backend=backend)
    dout = torch.randn_like(out)

    def ref(q_, k_, v_, upcast):
        return reference.attention(q_, k_, v_, causal=causal, window_size=window, upcast=upcast)

    _compare(out, lse, (q, k, v), ref, dout)


def _varlen(backend, lens_q, lens_k, hq, hk, d, causal, window=(-1, -1), layout="thd", same_cu=False):
    torch.manual_seed(0)
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = cu_q if same_cu else torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32,
                                             device="cuda")
    tq, tk = sum(lens_q), sum(lens_k)

    def mk(t, h):
        shape = (t, h, d) if layout == "thd" else (h, t, d)
        return torch.randn(shape, device="cuda", dtype=DT, requires_grad=True)

    q, k, v = mk(tq, hq), mk(tk, hk), mk(tk, hk)
    with poison_outputs():
        out, lse, _ = da.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                window_size=window, return_attn_probs=True, layout=layout,
                                                backend=backend)
    dout = torch.randn_like(out)

    def ref(q_, k_, v_, upcast):
        return reference.attention_varlen(q_, k_, v_, cu_q, cu_k, causal=causal, window_size=window,
                                          layout=layout, upcast=upcast)

    _compare(out, lse, (q, k, v), ref, dout)


LQ = [17, 0, 63, 1, 200, 97, 5]
LK = [5, 17, 30, 0, 200, 130, 5]        # Sq > Sk (causal rows with no key), Sk = 0, Sq = 0


# ----------------------------------------------------------------------------- cudnn, dense
@pytest.mark.parametrize("d,causal", [(64, True), (128, False)])
def test_cudnn_dense_sdpa_route(d, causal):
    _dense("cudnn", 2, 257, 257, 4, 4, d, causal)


@needs_frontend
@pytest.mark.parametrize("case", [
    dict(b=2, sq=97, sk=63, hq=8, hk=2, d=64, causal=True),                   # GQA, Sq > Sk bottom-right
    dict(b=1, sq=63, sk=130, hq=4, hk=4, d=128, causal=True),                 # Sq < Sk
    dict(b=2, sq=200, sk=200, hq=4, hk=4, d=64, causal=True, window=(32, 0)),
    dict(b=1, sq=150, sk=190, hq=4, hk=2, d=64, causal=False, window=(16, 8)),
], ids=["gqa_sq_gt_sk", "sq_lt_sk", "window_causal", "window_both"])
def test_cudnn_dense_graph_route(case):
    _dense("cudnn", **case)


# ----------------------------------------------------------------------------- cudnn, varlen
@needs_frontend
@pytest.mark.parametrize("layout", ["thd", "htd"])
def test_cudnn_varlen_same_cu_gqa(layout):
    _varlen("cudnn", LQ, LQ, 8, 2, 64, True, layout=layout, same_cu=True)


@needs_frontend
@pytest.mark.parametrize("layout", ["thd", "htd"])
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_varlen_sq_ne_sk(layout, causal):
    _varlen("cudnn", LQ, LK, 4, 4, 128, causal, layout=layout)


@needs_frontend
@pytest.mark.parametrize("window", [(32, 0), (16, 8), (8, -1)])
def test_cudnn_varlen_window(window):
    _varlen("cudnn", LQ, LK, 8, 2, 64, False, window=window)


@needs_frontend
def test_cudnn_graph_cache_reused_when_cu_seqlens_change():
    from delta_attn.ops.flash import cudnn as C
    _varlen("cudnn", [100, 37, 250], [100, 37, 250], 4, 4, 64, True, same_cu=True)
    before = C.graph_cache_stats()
    _varlen("cudnn", [120, 30, 201], [120, 30, 201], 4, 4, 64, True, same_cu=True)   # same buckets
    after = C.graph_cache_stats()
    assert after["builds"] == before["builds"], (before, after)
    assert after["hits"] >= before["hits"] + 2


# ----------------------------------------------------------------------------- sdpa
@pytest.mark.parametrize("case", [
    dict(b=2, sq=257, sk=257, hq=4, hk=4, d=64, causal=True),
    dict(b=2, sq=97, sk=63, hq=8, hk=2, d=64, causal=True),
    dict(b=1, sq=150, sk=190, hq=4, hk=2, d=128, causal=False, window=(16, 8)),
], ids=["causal", "gqa_sq_gt_sk", "window"])
def test_sdpa_dense(case):
    _dense("sdpa", **case)


@pytest.mark.parametrize("layout", ["thd", "htd"])
def test_sdpa_varlen(layout):
    _varlen("sdpa", LQ, LK, 8, 2, 64, True, layout=layout)


def test_sdpa_dense_float32_memory_efficient():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 100, 2, 64, device="cuda", requires_grad=True) for _ in range(3))
    out, lse, _ = da.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, backend="sdpa")
    dout = torch.randn_like(out)
    _compare(out, lse, (q, k, v),
             lambda q_, k_, v_, upcast: reference.attention(q_, k_, v_, causal=True, upcast=upcast), dout)


def test_auto_on_gpu_explains_choice():
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=DT)
    ex = da.explain(da.flash_attn_func, q, q, q, causal=True)
    assert ex.chosen in ("cudnn", "triton", "sdpa")
    assert "policy:" in str(ex)


@needs_frontend
def test_cudnn_varlen_htd_through_transposed_copy(monkeypatch):
    from delta_attn.ops.flash import cudnn as C
    monkeypatch.setattr(C, "HTD_MAX_TOTALS", 0)        # every new "htd" total goes through the thd graphs
    _varlen("cudnn", LQ, LK, 4, 2, 64, True, layout="htd")


@needs_frontend
def test_cudnn_deterministic_backward_is_bitwise_repeatable():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=DT, requires_grad=True) for _ in range(3))
    grads = []
    for _ in range(2):
        out = da.flash_attn_func(q, k, v, causal=True, deterministic=True, backend="cudnn")
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        grads.append((gq, gk, gv))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
