"""Every attention backend computes the contract exactly or declares the call unsupported.

Seeded random configurations (``draw`` of tests/attention_cases.py): dense and varlen (zero-length q and k
sequences, Sq != Sk per sequence, ``thd`` / ``htd``), Sq > Sk (rows that see no key), causal, windows (``(0, -1)``
included), GQA, head dims that are not multiples of 8, softmax scales (negative and zero included), softcap (which
sdpa / cudnn refuse), fp32 / fp16 / bf16 / fp64. For every backend of the registry: when ``da.explain(...,
backend=name)`` says it can run the call, its output, LSE and (for some configurations) gradients must pass the
error rule (docs/TESTING.md) against the float64 reference (outputs poisoned); when it says it cannot, ``auto``
must pass it over with the same reasons and an explicit request must raise :class:`UnsupportedError` naming them.

Also here: ``auto`` on CPU tensors runs PyTorch SDPA's CPU kernel (and is faster than the reference),
the Triton interpreter's bf16 ``tl.dot`` (wrong on the installed Triton) is declared, and the wrapper of
the CUDA FlashAttention-2 path (``ops/flash/sdpa.py``) is exercised on CPU against a stand-in kernel that has
FA2's arithmetic. ``tests/gpu/test_sdpa_gpu.py`` runs the same configurations on a GPU.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

import delta_attn as da
from delta_attn import backends, reference
from delta_attn.backends import UnsupportedError
from delta_attn.testing import check

from attention_cases import DTYPES, cu_seqlens, draw, run_case

BACKENDS = [n for n in backends.BACKEND_NAMES if n != "auto"]
SEEDS = range(64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_backend_matches_reference_or_declares(seed, backend):
    run_case(draw(seed), backend)


def test_the_draws_cover_the_hard_cases():
    cases = [draw(s) for s in SEEDS]
    assert any(c.lens_q and 0 in c.lens_q for c in cases) and any(c.lens_k and 0 in c.lens_k for c in cases)
    assert any(c.lens_q is None and c.sq > c.sk and c.causal for c in cases)
    assert any(c.lens_q is None and c.sk == 0 for c in cases)
    assert any(c.window == (0, -1) for c in cases) and any(c.hq != c.hk for c in cases)
    assert any(c.scale is not None and c.scale < 0 for c in cases) and any(c.scale == 0.0 for c in cases)
    assert {c.dtype for c in cases} == set(DTYPES) and any(c.grad for c in cases)
    assert any(c.d % 8 for c in cases) and {c.layout for c in cases} == {"thd", "htd"}
    assert any(c.softcap for c in cases)


# ---------------------------------------------------------------------------------------------
# auto on CPU: PyTorch SDPA's CPU kernel wherever it computes the contract
# ---------------------------------------------------------------------------------------------

def _dense(sq=17, sk=17, hq=4, hk=4, d=32, dt=torch.float32, dv=None):
    return (torch.randn(1, sq, hq, d, dtype=dt), torch.randn(1, sk, hk, d, dtype=dt),
            torch.randn(1, sk, hk, dv or d, dtype=dt))


@pytest.mark.parametrize("kw, shape", [
    (dict(causal=True), dict()),
    (dict(causal=True, softmax_scale=-0.5), dict()),     # the CPU kernel's is_causal masks before it scales
    (dict(causal=True, softmax_scale=0.0), dict(hk=2)),
    (dict(causal=True), dict(sq=9, sk=23)),              # bottom-right causal with Sq < Sk: an explicit mask
    (dict(causal=True), dict(sq=23, sk=9)),              # Sq > Sk: the first rows see no key
    (dict(window_size=(0, -1)), dict(sq=9, sk=23)),
    (dict(window_size=(4, 2), softmax_scale=-0.7), dict(hk=1)),
    (dict(), dict(dt=torch.float16, d=20)),
    (dict(causal=True), dict(dt=torch.bfloat16)),
])
def test_auto_on_cpu_runs_the_sdpa_cpu_kernel(kw, shape):
    q, k, v = _dense(**shape)
    ex = da.explain(da.flash_attn_func, q, k, v, **kw)
    assert ex.chosen == "sdpa", str(ex)
    out, lse, _ = da.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    o64, l64 = reference.attention(q.double(), k.double(), v.double(), **kw)
    olo, llo = reference.attention(q, k, v, upcast=False, **kw)
    assert check(out, o64, olo).ok and check(lse, l64, llo, name="lse").ok


def test_auto_on_cpu_runs_varlen_on_the_sdpa_cpu_kernel():
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 9, 9], dtype=torch.int32)
    q, k, v = torch.randn(12, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    ex = da.explain(da.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 7, 6, causal=True)
    assert ex.chosen == "sdpa", str(ex)


@pytest.mark.parametrize("kw, shape, why", [
    (dict(softcap=5.0), dict(), "does not support softcap"),
    (dict(alibi_slopes=torch.rand(4)), dict(), "does not support alibi"),
    (dict(dropout_p=0.1), dict(), "does not support dropout"),
    (dict(), dict(dv=16), "does not support head_dim_v"),
])
def test_auto_on_cpu_falls_back_to_the_reference_with_the_reason(kw, shape, why):
    q, k, v = _dense(**shape)
    ex = da.explain(da.flash_attn_func, q, k, v, **kw)
    assert ex.chosen == "torch"
    assert any(why in r for r in dict(ex.considered)["sdpa"]), str(ex)
    assert "sdpa: passed over — " in str(ex) and why in str(ex)


def _best_of(n, fn):
    best = math.inf
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def test_auto_on_cpu_is_faster_than_the_reference():
    """Measured 4-18x (forward) at S = 256-2048 (docs/DISPATCH.md). One thread: on a loaded 2-core machine
    an OpenMP region waits for a descheduled thread (milliseconds), which would time the machine."""
    q, k, v = (torch.randn(1, 512, 8, 64) for _ in range(3))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            auto = _best_of(3, lambda: da.flash_attn_func(q, k, v, causal=True))
            ref = _best_of(3, lambda: da.flash_attn_func(q, k, v, causal=True, backend="torch"))
    finally:
        torch.set_num_threads(threads)
    assert auto * 1.5 < ref, (auto, ref)


def test_cpu_sdpa_compiles_dense_without_graph_breaks():
    q, k, v = _dense(sq=9, sk=23, hk=2)
    f = torch.compile(lambda a, b, c: da.flash_attn_func(a, b, c, causal=True, backend="sdpa"), fullgraph=True,
                      backend="eager")
    torch.testing.assert_close(f(q, k, v), da.flash_attn_func(q, k, v, causal=True, backend="sdpa"))


# ---------------------------------------------------------------------------------------------
# the Triton interpreter's bf16 tl.dot
# ---------------------------------------------------------------------------------------------

def test_triton_interpreter_bf16_is_declared(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _dense(dt=torch.bfloat16)
    # sdpa would take it first: hide it to see what auto does with Triton
    monkeypatch.setattr(backends.BACKENDS["sdpa"], "not_supported_reasons", lambda call: ["hidden in this test"])
    ex = da.explain(da.flash_attn_func, q, k, v, causal=True)
    assert ex.chosen == "torch", str(ex)
    why = dict(ex.considered)["triton"]
    assert any("interpreter" in r and "bfloat16" in r for r in why), str(ex)
    with pytest.raises(UnsupportedError, match="interpreter"):
        da.flash_attn_func(q, k, v, causal=True, backend="triton")
    x = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    for op, args in ((da.kda, (x, x, x, -torch.rand_like(x), torch.rand(1, 8, 2, dtype=torch.bfloat16))),):
        assert any("interpreter" in r for r in dict(da.explain(op, *args).considered)["triton"])
    # the ops without tl.dot too: the interpreter's float32 -> bfloat16 casts truncate
    assert any("interpreter" in r for r in dict(da.explain(da.gated_diag_attn, x, x, x, -torch.rand_like(x)).considered)["triton"])
    # float16 stays on Triton
    assert da.explain(da.flash_attn_func, *_dense(dt=torch.float16), backend="triton").chosen == "triton"
    x16 = x.half()
    assert da.explain(da.gated_diag_attn, x16, x16, x16, -torch.rand_like(x16), backend="triton").chosen == "triton"


def test_triton_interpreter_bf16_dot_is_still_wrong():
    """The reason above holds on the installed Triton; when this fails, lift the rule in backends.py."""
    triton = pytest.importorskip("triton")
    import os
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the Triton interpreter is off")
    import triton.language as tl

    @triton.jit
    def _dot(a, b, c, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(a + i[:, None] * N + i[None, :])
        y = tl.load(b + i[:, None] * N + i[None, :])
        tl.store(c + i[:, None] * N + i[None, :], tl.dot(x, y))

    a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    c = torch.empty(16, 16)
    _dot[(1,)](a, b, c, 16)
    err = float((c - a.float() @ b.float()).abs().max())
    assert not err < 1.0, f"tl.dot on bf16 is right on Triton {triton.__version__} (error {err:.2e}): lift the rule"


# ---------------------------------------------------------------------------------------------
# the CUDA FlashAttention-2 wrapper of ops/flash/sdpa.py, on CPU against a stand-in kernel
# ---------------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634


def _fa2_scores(q, k, cu_q, cu_k, max_k, is_causal, window_size_left, window_size_right):
    """FA2's argument handling (flash_api.cpp), then per sequence that has rows and keys:
    (q0, q1, k0, k1, q (Hq, Lq, D), k (Hq, Lk, D), raw scores (Hq, Lq, Lk) masked with -inf), fp32."""
    wl = -1 if window_size_left is None else window_size_left
    wr = -1 if window_size_right is None else window_size_right
    if is_causal:
        wr = 0
    wl, wr = (-1 if w >= max_k else w for w in (wl, wr))
    # set_params_fprop: the missing bound of a local window becomes max_seqlen_k
    if wl < 0 <= wr:
        wl = max_k
    elif wr < 0 <= wl:
        wr = max_k
    g = q.shape[1] // k.shape[1]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        if q1 == q0 or k1 == k0:
            continue
        qs = q[q0:q1].float().transpose(0, 1)
        ks = k[k0:k1].float().transpose(0, 1).repeat_interleave(g, 0)
        raw = (qs @ ks.transpose(1, 2)).masked_fill(~reference.attention_mask(q1 - q0, k1 - k0, (wl, wr)),
                                                    float("-inf"))
        yield q0, q1, k0, k1, qs, ks, raw


def _fa2_standin(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
                 window_size_left=None, window_size_right=None, **_):
    """FA2's forward arithmetic: -inf masking of the raw scores, the row max taken on the raw scores
    and ``exp2(s * scale * log2e - max * scale * log2e)``, lse = max * scale + log(sum). Rows that see
    no key are left unwritten (NaN): the wrapper must give the contract's zeros / +inf whatever a
    kernel writes there."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"))
    g = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1, _, _, raw in _fa2_scores(q, k, cu_q, cu_k, max_k, is_causal, window_size_left,
                                                 window_size_right):
        vs = v[k0:k1].float().transpose(0, 1).repeat_interleave(g, 0)
        m = raw.amax(-1, keepdim=True)
        p = torch.exp2(raw * (scale * _LOG2E) - m * (scale * _LOG2E))
        s = p.sum(-1, keepdim=True)
        out[q0:q1] = ((p @ vs) / s).transpose(0, 1).to(q.dtype)
        lse[:, q0:q1] = (m * scale + torch.log(s)).squeeze(-1)
    empty = torch.empty(0)
    return out, lse, empty, empty, empty


def _fa2_standin_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state,
                          unused, *, scale=None, window_size_left=None, window_size_right=None):
    """FA2's backward arithmetic from the saved lse: P = exp(s * scale - lse) on the -inf-masked raw
    scores, dS = P * (dO V^T - rowsum(dO * O)), dq = scale dS K, dk = scale dS^T q, dv = P^T dO."""
    hk, g = k.shape[1], q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
    for q0, q1, k0, k1, qs, ks, raw in _fa2_scores(q, k, cu_q, cu_k, max_k, is_causal, window_size_left,
                                                   window_size_right):
        do, o = (t[q0:q1].float().transpose(0, 1) for t in (dout, out))
        vs = v[k0:k1].float().transpose(0, 1).repeat_interleave(g, 0)
        p = torch.exp(raw * scale - lse[:, q0:q1, None])
        ds = p * (do @ vs.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
        dq[q0:q1] = (scale * ds @ ks).transpose(0, 1)
        dk[k0:k1] = (scale * ds.transpose(1, 2) @ qs).unflatten(0, (hk, g)).sum(1).transpose(0, 1)
        dv[k0:k1] = (p.transpose(1, 2) @ do).unflatten(0, (hk, g)).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fa2(args):
    """The sdpa backend's CUDA FA2 path: the contract preparation, then the kernel wrapper."""
    from delta_attn.ops.flash import sdpa
    from delta_attn.ops.flash.contract import prepare
    args, done = prepare(args)
    return done if done is not None else sdpa._flash(args)


@pytest.fixture
def fa2_standin(monkeypatch):
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _fa2_standin, raising=False)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", _fa2_standin_backward, raising=False)


@pytest.mark.parametrize("kw, sq, sk", [
    (dict(causal=True, softmax_scale=-0.6), 17, 17),      # negative scale: masked -inf becomes +inf
    (dict(softmax_scale=-0.6), 9, 23),
    (dict(window_size=(0, -1), softmax_scale=-0.6), 9, 23),
    (dict(window_size=(0, -1)), 23, 9),
    (dict(window_size=(0, -1)), 257, 97),                 # FA2 turns the open right bound into max_seqlen_k
    (dict(window_size=(3, 100)), 300, 97),                # FA2 drops a bound >= max_seqlen_k
    (dict(causal=True), 23, 9),                           # the first 14 rows see no key
    (dict(causal=True, window_size=(2, 1), softmax_scale=0.0), 23, 9),
    (dict(), 5, 0),                                       # no key at all
])
def test_fa2_wrapper_dense_computes_the_contract(fa2_standin, kw, sq, sk):
    from delta_attn.ops.flash.api import validate_dense
    q, k, v = _dense(sq, sk, 4, 2, 16, torch.float16)
    q, k, v = q.repeat(2, 1, 1, 1), k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)
    out, lse = _fa2(validate_dense(q, k, v, **kw))
    o64, l64 = reference.attention(q.double(), k.double(), v.double(), **kw)
    olo, llo = reference.attention(q, k, v, upcast=False, **kw)
    assert check(out, o64, olo).ok, check(out, o64, olo).message
    assert check(lse, l64, llo, name="lse").ok, check(lse, l64, llo, name="lse").message


@pytest.mark.parametrize("layout", ["thd", "htd"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, softmax_scale=-1.1),
                                dict(window_size=(0, -1))])
def test_fa2_wrapper_varlen_computes_the_contract(fa2_standin, kw, layout):
    from delta_attn.ops.flash.api import validate_varlen
    lq, lk = (0, 7, 12, 3, 5), (4, 0, 5, 3, 9)
    cu_q, cu_k = cu_seqlens(lq, "cpu"), cu_seqlens(lk, "cpu")
    shp = (lambda t, h: (t, h, 16)) if layout == "thd" else (lambda t, h: (h, t, 16))
    q, k, v = (torch.randn(shp(t, h)).half() for t, h in ((sum(lq), 4), (sum(lk), 2), (sum(lk), 2)))
    out, lse = _fa2(validate_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), layout=layout, **kw))
    o64, l64 = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, layout=layout, **kw)
    olo, llo = reference.attention_varlen(q, k, v, cu_q, cu_k, layout=layout, upcast=False, **kw)
    assert check(out, o64, olo).ok, check(out, o64, olo).message
    assert check(lse, l64, llo, name="lse").ok, check(lse, l64, llo, name="lse").message


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_fa2_wrapper_gradients(fa2_standin, varlen):
    """The backward is fed the wrapper's out / lse (zeros / +inf on rows that see no key): dq is zero there."""
    from delta_attn.ops.flash.api import validate_dense, validate_varlen
    kw = dict(causal=True, softmax_scale=-0.8)
    if varlen:
        lq, lk = (9, 0, 12, 6), (4, 5, 0, 9)
        cu_q, cu_k = cu_seqlens(lq, "cpu"), cu_seqlens(lk, "cpu")
        xs = [torch.randn(t, h, 16).half().requires_grad_() for t, h in ((sum(lq), 4), (sum(lk), 2), (sum(lk), 2))]

        def ref(*a, upcast):
            return reference.attention_varlen(*a, cu_q, cu_k, upcast=upcast, **kw)
        args = validate_varlen(*xs, cu_q, cu_k, max(lq), max(lk), **kw)
    else:
        xs = [t.requires_grad_() for t in _dense(23, 9, 4, 2, 16, torch.float16)]

        def ref(*a, upcast):
            return reference.attention(*a, upcast=upcast, **kw)
        args = validate_dense(*xs, **kw)
    out, _ = _fa2(args)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, xs, dout)
    r64 = [t.detach().double().requires_grad_() for t in xs]
    rlo = [t.detach().clone().requires_grad_() for t in xs]
    want64 = torch.autograd.grad(ref(*r64, upcast=True)[0], r64, dout.double())
    wantlo = torch.autograd.grad(ref(*rlo, upcast=False)[0], rlo, dout)
    for name, a, w64, wlo in zip(("dq", "dk", "dv"), got, want64, wantlo):
        v = check(a, w64, wlo, kind="grad", name=name)
        assert v.ok, v.message
