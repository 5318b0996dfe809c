"""KDA on the Triton backend, run by the interpreter on CPU (fp32 / fp16; bf16 only on the GPU).

Every result is compared with the float64 reference under the DESIGN error rule (the same
computation in the input dtype, ``upcast=False``, is the baseline); outputs are poisoned first.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

import delta_attn as da
from delta_attn import reference as ref
from delta_attn.backends import UnsupportedError
from delta_attn.testing import assert_close
from delta_attn.ops.kda.prep_lean import _kda_tri_inverse_dots

pytestmark = pytest.mark.usefixtures("poisoned")


def make(B, T, H, HV, K, V, dtype, gate=None, decay=None, h0=False, cu=None):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = (torch.randn(B, T, H, K) * K ** -0.5).to(dtype)   # |k| ~ 1: a stable delta rule without l2norm
    v = torch.randn(B, T, HV, V, dtype=dtype)
    if gate is None:
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K) + 2.0)
        if decay is not None:      # strongly negative decays at random tokens / channels
            hit = torch.rand(B, T, HV, K) < 0.15
            g = torch.where(hit, torch.full_like(g, decay), g)
        g = g.to(dtype)
    else:
        g = torch.randn(B, T, HV, K, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=dtype)
    kw = {}
    if gate is not None:
        kw["A_log"] = torch.randn(HV) * 0.5
        kw["dt_bias"] = torch.randn(HV * K) * 0.5
        if gate == "lower_bound":
            kw["lower_bound"] = -5.0
    n = B if cu is None else len(cu) - 1
    if h0:
        kw["initial_state"] = torch.randn(n, HV, K, V) * 0.5
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    return [q, k, v, g, beta], kw


def run(backend, xs, kw, grad=False, seed=1, **opts):
    """kda on a backend; with grad, (o, final, grads of every tensor input) for a random loss."""
    names = [n for n in ("initial_state", "A_log", "dt_bias") if n in kw]
    if backend == "ref64":
        xs = [x.double() for x in xs]
        kw = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in kw.items()}
    if grad:
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        kw = {n: (t.detach().clone().requires_grad_(True) if n in names else t) for n, t in kw.items()}
    if backend in ("ref64", "ref_low"):
        o, s = ref.kda(*xs, **kw, upcast=backend == "ref64", **opts)
    else:
        o, s = da.kda(*xs, **kw, backend="triton", **opts)
    if not grad:
        return o, s, []
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen).to(o.dtype)).sum()
    if s is not None:
        loss = loss + (s * torch.randn(s.shape, generator=gen).to(s.dtype)).sum()
    leaves = xs + [kw[n] for n in names]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return o, s, [torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves, grads)]


def check_all(xs, kw, grad=False, **opts):
    out = run("triton", xs, kw, grad, **opts)
    r64 = run("ref64", xs, kw, grad, **opts)
    low = run("ref_low", xs, kw, grad, **opts)
    assert_close(out[0], r64[0], low[0], name="o")
    if out[1] is not None:
        assert out[1].dtype == torch.float32
        assert_close(out[1], r64[1], low[1], name="final_state")
    names = ["dq", "dk", "dv", "dg", "dbeta"] + ["d_" + n for n in ("initial_state", "A_log", "dt_bias") if n in kw]
    for name, a, b, c in zip(names, out[2], r64[2], low[2]):
        assert_close(a, b, c, kind="grad", name=name)
    return out


# ---------------------------------------------------------------------------------------------
# forward at odd lengths, every option
# ---------------------------------------------------------------------------------------------

@pytest.fixture(params=[16, 64], ids=["fwd16", "fwd64"])
def fwd_chunk(request, monkeypatch):
    """The forward's chunk length: 16 (default) or the opt-in forward-only 64-token path."""
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "fwd_chunk", request.param)
    return request.param


@pytest.mark.parametrize("T,dtype,opts", [
    (1, torch.float32, dict()),
    (17, torch.float16, dict(h0=True, l2=True, H=1, HV=2)),
    (63, torch.float32, dict(gate="softplus", final=True)),
    (65, torch.float16, dict(gate="lower_bound", l2=True, final=True)),
    (130, torch.float32, dict(l2=True, H=2, HV=4, h0=True, final=True, K=32)),
])
def test_forward_odd_lengths(T, dtype, opts, fwd_chunk):
    H, HV, K = opts.get("H", 1), opts.get("HV", 1), opts.get("K", 16)
    xs, kw = make(1, T, H, HV, K, 16, dtype, gate=opts.get("gate"), h0=opts.get("h0", False))
    check_all(xs, kw, use_qk_l2norm=opts.get("l2", False), output_final_state=opts.get("final", False),
              scale=0.3 if T == 63 else None)


# ---------------------------------------------------------------------------------------------
# forward on both chunk lengths: varlen, strong decays, both intra-chunk factorisations
# ---------------------------------------------------------------------------------------------

def _check_varlen_with_empty_sequences(cu, k_dim, gate):
    """Against the reference, and sequences 1 and 5 (empty) end in their initial state."""
    xs, kw = make(1, cu[-1], 1, 2, k_dim, 16, torch.float16, gate=gate, h0=True, cu=cu)
    out = check_all(xs, kw, use_qk_l2norm=True, output_final_state=True)
    assert torch.equal(out[1][1], kw["initial_state"][1])
    assert torch.equal(out[1][5], kw["initial_state"][5])


def test_forward_varlen_with_empty_sequences(fwd_chunk):
    # a 65-token sequence spans two 64-token chunks
    _check_varlen_with_empty_sequences([0, 5, 5, 70, 71, 140, 140], 16, "lower_bound")


@pytest.mark.parametrize("decay,dtype", [(-50.0, torch.float32), (-1e4, torch.float16),
                                         (float("-inf"), torch.float32)])
def test_forward_strong_decays(decay, dtype, fwd_chunk):
    xs, kw = make(1, 97, 1, 1, 48, 16, dtype, decay=decay, h0=True)    # K = 48: a partial K slice
    out = check_all(xs, kw, use_qk_l2norm=True, output_final_state=True)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("factor_max", [-1.0, 1e9])
def test_forward64_safe_and_fast_paths(monkeypatch, factor_max):
    """The 64-token prep takes, per K slice, the one-reference factored products (every |G| <=
    factor_max, relative to the chunk's middle token) or the safe ones (sub-chunk references off the
    diagonal, exact pairwise on it): force each in turn. Half the channels decay by ~1.5 per token
    (~96 per chunk: exp(96) overflows fp32, so only the middle reference keeps the fast path finite)."""
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "fwd_chunk", 64)
    monkeypatch.setitem(triton_impl.CONFIG, "factor_max", factor_max)
    xs, kw = make(2, 130, 1, 2, 32, 16, torch.float32, h0=True)
    xs[3][..., 16:] = -1.4 - 0.2 * torch.rand(2, 130, 2, 16)
    out = check_all(xs, kw, use_qk_l2norm=True, output_final_state=True)
    assert torch.isfinite(out[0]).all()


def test_forward64_is_taken_without_grad_only(monkeypatch):
    """fwd_chunk = 64 runs the 64-token path when no gradient is needed; with gradients the autograd
    Function follows train_chunk (16 here); any other value is an error."""
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "fwd_chunk", 64)
    monkeypatch.setitem(triton_impl.CONFIG, "train_chunk", 16)
    calls = []
    real = triton_impl._kda_fwd64
    monkeypatch.setattr(triton_impl, "_kda_fwd64", lambda *a: calls.append(1) or real(*a))
    xs, kw = make(1, 70, 1, 1, 16, 16, torch.float32, h0=True)
    o64, s64, _ = run("triton", xs, kw, output_final_state=True)
    assert len(calls) == 1
    o16, s16, _ = run("triton", xs, kw, grad=True, output_final_state=True)
    assert len(calls) == 1
    torch.testing.assert_close(o64, o16.detach(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s64, s16.detach(), atol=2e-5, rtol=1e-4)
    monkeypatch.setitem(triton_impl.CONFIG, "fwd_chunk", 32)
    with pytest.raises(ValueError, match="fwd_chunk"):
        run("triton", xs, kw)


# ---------------------------------------------------------------------------------------------
# opt-in forward variants of the 16-token prep (CONFIG["fwd_variant"]): factored launch + exact
# launch for flagged chunks, q/k/g in K slices, no T, Aqk in the working dtype; "lean_dots" inverts
# the UT matrix with dots
# ---------------------------------------------------------------------------------------------

def _set_variant(monkeypatch, variant, chunk):
    from delta_attn.ops.kda import triton_impl
    for key, val in dict(fwd_chunk=16, fwd_variant=variant, lean_chunk=chunk, lean_ks=32).items():
        monkeypatch.setitem(triton_impl.CONFIG, key, val)


@pytest.fixture(params=[("lean", 16), ("lean_dots", 32)], ids=["lean", "lean_dots32"])
def fwd_variant(request, monkeypatch):
    """The variant and its chunk length (lean_chunk: 16 or 32); lean_dots at 16 in the varlen test."""
    _set_variant(monkeypatch, *request.param)
    return request.param


@pytest.mark.parametrize("T,dtype,opts", [
    (17, torch.float16, dict(h0=True, H=1, HV=2, K=48)),                 # K = 48: a partial K slice
    (63, torch.float32, dict(gate="softplus", final=True, K=64)),
    (130, torch.float16, dict(gate="lower_bound", l2=True, final=True, h0=True, K=32)),
])
def test_forward_variant_odd_lengths(T, dtype, opts, fwd_variant):
    H, HV, K = opts.get("H", 1), opts.get("HV", 1), opts.get("K", 16)
    xs, kw = make(1, T, H, HV, K, 16, dtype, gate=opts.get("gate"), h0=opts.get("h0", False))
    check_all(xs, kw, use_qk_l2norm=opts.get("l2", True), output_final_state=opts.get("final", False),
              scale=0.3 if T == 63 else None)


@pytest.mark.parametrize("variant,chunk", [("lean", 16), ("lean_dots", 16), ("lean_dots", 32)])
def test_forward_variant_varlen_with_empty_sequences(monkeypatch, variant, chunk):
    _set_variant(monkeypatch, variant, chunk)
    _check_varlen_with_empty_sequences([0, 5, 5, 21, 22, 57, 57], 32, "softplus")


@pytest.mark.parametrize("decay,dtype", [(-50.0, torch.float32), (-1e4, torch.float16),
                                         (float("-inf"), torch.float32)])
def test_forward_variant_strong_decays(decay, dtype, fwd_variant):
    """Strong decays in the first 48 tokens only: those chunks are flagged and redone by the exact
    launch, the later ones stay on the factored launch (both launches' outputs in one result)."""
    xs, kw = make(1, 97, 1, 1, 48, 16, dtype, decay=decay, h0=True)
    xs[3][:, 48:] = torch.nn.functional.logsigmoid(torch.randn(1, 49, 1, 48) + 2.0).to(dtype)
    from delta_attn.ops.kda import triton_impl
    seen = []
    real = triton_impl._kda_fwd_prep_lean_kernel

    class Spy:          # records the flags after the exact launch
        def __getitem__(self, grid):
            def launch(*a, **kw_):
                real[grid](*a, **kw_)
                if kw_["EXACT"]:
                    seen.append(a[14].clone())
            return launch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_impl, "_kda_fwd_prep_lean_kernel", Spy())
        out = check_all(xs, kw, use_qk_l2norm=True, output_final_state=True)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()
    flags = seen[0].flatten().tolist()
    assert flags[0] == 1 and flags[-1] == 0, flags


@pytest.mark.parametrize("factor_max", [-1.0, 1e9])
def test_forward_variant_exact_and_factored_launches(monkeypatch, factor_max, fwd_variant):
    """Every chunk on the exact launch (factor_max < 0) or on the factored one (1e9)."""
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "factor_max", factor_max)
    # plain decays (the forced factored form overflows beyond |G| ~ 88 in a chunk: lower_bound -5 would
    # reach it within 32 tokens)
    xs, kw = make(2, 37, 1, 2, 32, 16, torch.float32, h0=True)
    check_all(xs, kw, use_qk_l2norm=True, output_final_state=True)


@triton.jit
def _kda_test_inverse_kernel(A, T, BT: tl.constexpr):
    """One program around prep_lean._kda_tri_inverse_dots (ieee dots)."""
    i = tl.arange(0, BT)
    a = tl.load(A + i[:, None] * BT + i[None, :])
    tl.store(T + i[:, None] * BT + i[None, :], _kda_tri_inverse_dots(a, BT, "ieee"))


def test_tri_inverse_dots_matches_inverse():
    """(I + A)^-1 as (I - A)(I + A^2)(I + A^4)(I + A^8) for a strictly lower 16 x 16 A with O(1)
    entries (every power up to A^15 matters), against float64 inversion."""
    A = torch.tril(torch.rand(16, 16) * 2 - 1, -1)
    T = torch.full_like(A, float("nan"))
    _kda_test_inverse_kernel[(1,)](A, T, BT=16)
    want = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + A.double())
    torch.testing.assert_close(T.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_no_grad_mode_takes_the_inference_forward(monkeypatch):
    """Under torch.no_grad, inputs that require grad get the forward without gradient (no kept
    intermediates, the inference chunk length): autograd's ctx.needs_input_grad ignores grad mode."""
    from delta_attn.ops.kda import triton_impl
    seen = []
    real = triton_impl.kda_fwd
    monkeypatch.setattr(triton_impl, "kda_fwd", lambda *a, **k_: seen.append(k_.get("store_states", False))
                        or real(*a, **k_))
    xs, kw = make(1, 40, 1, 1, 16, 16, torch.float32, h0=True)
    leaves = [x.detach().requires_grad_() for x in xs]
    with torch.no_grad():
        o, s = da.kda(*leaves, use_qk_l2norm=True, output_final_state=True, backend="triton", **kw)
    assert seen == [False] and o.grad_fn is None and s.grad_fn is None
    o2, s2 = da.kda(*leaves, use_qk_l2norm=True, output_final_state=True, backend="triton", **kw)
    assert seen == [False, True] and o2.grad_fn is not None
    torch.testing.assert_close(o, o2.detach(), atol=2e-5, rtol=1e-4)


def test_forward_variant_is_taken_without_grad_only(monkeypatch):
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "fwd_chunk", 16)
    monkeypatch.setitem(triton_impl.CONFIG, "train_chunk", 16)
    monkeypatch.setitem(triton_impl.CONFIG, "fwd_variant", "lean")
    calls = []
    real = triton_impl._prep_lean
    monkeypatch.setattr(triton_impl, "_prep_lean", lambda *a, **k_: calls.append(1) or real(*a, **k_))
    xs, kw = make(1, 40, 1, 1, 16, 16, torch.float32, h0=True)
    o1, s1, _ = run("triton", xs, kw, output_final_state=True)
    assert len(calls) == 1
    o2, s2, _ = run("triton", xs, kw, grad=True, output_final_state=True)
    assert len(calls) == 1
    torch.testing.assert_close(o1, o2.detach(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s1, s2.detach(), atol=2e-5, rtol=1e-4)
    monkeypatch.setitem(triton_impl.CONFIG, "fwd_variant", "fast")
    with pytest.raises(ValueError, match="fwd_variant"):
        run("triton", xs, kw)


def test_env_settings_name_the_variable(monkeypatch):
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setenv("DELTA_ATTN_KDA_FWD_CHUNK", "sixteen")
    with pytest.raises(ValueError, match="DELTA_ATTN_KDA_FWD_CHUNK must be an integer"):
        triton_impl._env_int("DELTA_ATTN_KDA_FWD_CHUNK", 16)
    monkeypatch.setenv("DELTA_ATTN_KDA_FWD_CHUNK", "64")
    assert triton_impl._env_int("DELTA_ATTN_KDA_FWD_CHUNK", 16) == 64


# ---------------------------------------------------------------------------------------------
# gradients (error rule, factor 3) for every differentiable input, on 16-token chunks (the default
# training chunk is 64: its tests follow)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def train16(monkeypatch):
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "train_chunk", 16)

@pytest.mark.parametrize("T,dtype,gate", [
    (17, torch.float32, None),
    (33, torch.float32, "softplus"),
    (20, torch.float16, "lower_bound"),
])
def test_gradients(T, dtype, gate, train16):
    xs, kw = make(1, T, 1, 2, 16, 32, dtype, gate=gate, h0=True)
    check_all(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)


def test_varlen_with_empty_sequences_and_grads(train16):
    cu = [0, 5, 5, 22, 23, 40, 40]
    xs, kw = make(1, 40, 1, 2, 16, 16, torch.float32, h0=True, cu=cu)
    out = check_all(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    # zero-length sequences pass their state through unchanged, gradient included
    assert torch.equal(out[1][1], kw["initial_state"][1])
    assert torch.equal(out[1][5], kw["initial_state"][5])


@pytest.mark.parametrize("decay,dtype", [(-50.0, torch.float32), (-1e4, torch.float16), (-1e4, torch.float32)])
def test_strong_decays(decay, dtype, train16):
    xs, kw = make(1, 37, 1, 1, 16, 16, dtype, decay=decay, h0=True)
    out = check_all(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    for t in [out[0], out[1]] + out[2]:
        assert torch.isfinite(t).all()


def test_minus_inf_is_a_reset(train16):
    xs, kw = make(1, 40, 1, 1, 16, 16, torch.float32, h0=True)
    xs[3][0, 20] = float("-inf")                   # every channel forgets at token 20
    o, s, grads = run("triton", xs, kw, grad=True, output_final_state=True, use_qk_l2norm=True)
    assert all(torch.isfinite(t).all() for t in [o, s] + grads)
    # after the reset, the output equals a fresh run started at token 20 from a zero state
    tail = [x[:, 20:].clone() for x in xs]
    tail[3][0, 0] = 0.0
    o2, s2, _ = run("triton", tail, {}, output_final_state=True, use_qk_l2norm=True)
    torch.testing.assert_close(o[:, 20:], o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s2, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# training on 64-token chunks (CONFIG["train_chunk"] = 64): forward keeping T / states, backward scan
# at BT = 64, the 64-token intra-chunk backward (factored or, for strong decays, exact per block)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def train64(monkeypatch):
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "train_chunk", 64)
    calls = []
    real = triton_impl._kda_bwd_intra64_kernel

    class Counted:                      # the 64-token backward must really run (two launches per backward:
        def __getitem__(self, grid):    # factored everywhere, then the flagged chunks exactly)
            def launch(*args, **kw):
                calls.append(kw["EXACT"])
                return real[grid](*args, **kw)
            return launch
    monkeypatch.setattr(triton_impl, "_kda_bwd_intra64_kernel", Counted())
    return calls


@pytest.mark.parametrize("T,dtype,opts", [
    (130, torch.float32, dict(gate="softplus", H=1, HV=2)),         # GVA, 3 chunks, the last of 2 tokens
    (65, torch.float16, dict(gate="lower_bound", H=2, HV=2, K=48)),  # K = 48: a partial K slice
    (70, torch.float32, dict(factor_max=-1.0)),                      # every K slice on the exact path
    (33, torch.float32, dict(bwd64_split=False, H=1, HV=2)),         # partial gradients inside the scan
    (100, torch.float16, dict(gate="softplus", intra64_round_tf32=True)),  # the GPU's tf32-rounded factors
    (70, torch.float16, dict(factor_max=-1.0, intra64_round_tf32=True)),   # the same on the exact path
])
def test_gradients64(T, dtype, opts, train64, monkeypatch):
    from delta_attn.ops.kda import triton_impl
    for key in ("factor_max", "bwd64_split", "intra64_round_tf32"):
        if key in opts:
            monkeypatch.setitem(triton_impl.CONFIG, key, opts[key])
    xs, kw = make(1, T, opts.get("H", 1), opts.get("HV", 1), opts.get("K", 16), 32, dtype, gate=opts.get("gate"),
                  h0=True)
    check_all(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    assert train64 == [False, True]


def test_varlen_gradients64_with_empty_sequences(train64):
    cu = [0, 5, 5, 70, 71, 140, 140]
    xs, kw = make(1, 140, 1, 2, 16, 16, torch.float32, h0=True, cu=cu)
    out = check_all(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    assert torch.equal(out[1][1], kw["initial_state"][1])
    assert train64 == [False, True]


@pytest.mark.parametrize("decay,dtype", [(-50.0, torch.float16), (float("-inf"), torch.float16)])
def test_strong_decays64(decay, dtype, train64):
    """Strong decays: the factored products fail their range check and the exact per-block path runs
    (off-diagonal blocks factored at the block boundary, diagonal blocks pairwise). fp16 inputs: in
    fp32, with decays <= -30 at 15% of the tokens, the 64-token gradients are 3-5x less accurate than
    the 16-token ones (relative ~5e-6, largest on the last tokens, which get the final-state gradient)
    and reach the error rule's absolute floor (dg 2.2e-5 vs 2.2e-5 allowed), where the fp32 reference
    recurrence itself is 100x more accurate."""
    xs, kw = make(1, 97, 1, 1, 48, 16, dtype, decay=decay, h0=True)
    out = check_all(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    for t in [out[0], out[1]] + out[2]:
        assert torch.isfinite(t).all()


def test_fast_path64_with_decays_beyond_the_start_reference(train64, monkeypatch):
    """~1.5 per token on half the channels (~96 per chunk): only the middle-token reference keeps the
    factored backward finite; a huge factor_max forces it for every slice."""
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "factor_max", 1e9)
    xs, kw = make(1, 64, 1, 1, 32, 16, torch.float32, h0=True)
    xs[3][..., 16:] = -1.4 - 0.2 * torch.rand(1, 64, 1, 16)
    check_all(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)


def test_custom_op_path64_matches_eager(train64, monkeypatch):
    """The recomputing backward of the custom op == the eager backward from saved intermediates, at 64."""
    xs, kw = make(1, 67, 1, 2, 16, 16, torch.float32, h0=True)
    eager = run("triton", xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = run("triton", xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    for a, b in zip([eager[0], eager[1]] + eager[2], [traced[0], traced[1]] + traced[2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert train64 == [False, True] * 2


# ---------------------------------------------------------------------------------------------
# structural identities
# ---------------------------------------------------------------------------------------------

def step_all(xs, state, idx=None, chunk=16, **opts):
    outs = []
    T = xs[0].shape[1]
    for t0 in range(0, T, chunk):
        sl = [x[:, t0:t0 + chunk] for x in xs]
        outs.append(da.kda_step(*sl, state, state_indices=idx, backend="triton", **opts))
    return torch.cat(outs, 1)


def test_chunked_equals_recurrent_and_halves():
    xs, kw = make(2, 45, 2, 4, 16, 32, torch.float32, gate="softplus")
    opts = dict(use_qk_l2norm=True, A_log=kw["A_log"], dt_bias=kw["dt_bias"])
    o, s = da.kda(*xs, output_final_state=True, backend="triton", **opts)
    # recurrent decode kernel over the whole sequence, 13 tokens per call, from a zero state
    state = torch.zeros(2, 4, 16, 32)
    o_rec = step_all(xs, state, chunk=13, **opts)
    torch.testing.assert_close(o_rec, o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state, s, atol=2e-5, rtol=1e-4)
    # two halves with the state carried == one pass
    a = [x[:, :23] for x in xs]
    b = [x[:, 23:] for x in xs]
    o1, s1 = da.kda(*a, output_final_state=True, backend="triton", **opts)
    o2, s2 = da.kda(*b, initial_state=s1, output_final_state=True, backend="triton", **opts)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s2, s, atol=2e-5, rtol=1e-4)


def test_prefill_then_decode_with_state_pool():
    xs, kw = make(3, 29, 1, 2, 16, 16, torch.float32, decay=-1e4)
    o_all, _ = da.kda(*xs, use_qk_l2norm=True, backend="triton")
    pre = [x[:, :20] for x in xs]
    _, s = da.kda(*pre, output_final_state=True, use_qk_l2norm=True, backend="triton")
    pool = torch.full((7, 2, 16, 16), 123.0)
    idx = torch.tensor([5, 0, 3], dtype=torch.int32)
    pool[idx.long()] = s
    o_dec = step_all([x[:, 20:] for x in xs], pool, idx, chunk=1, use_qk_l2norm=True)
    torch.testing.assert_close(o_dec, o_all[:, 20:], atol=2e-5, rtol=1e-4)
    untouched = [1, 2, 4, 6]
    assert (pool[untouched] == 123.0).all()
    # and against the reference decode (torch backend), several tokens per call, fp16 inputs
    xs16 = [x[:, :5].half() for x in xs]
    p1 = torch.randn(7, 2, 16, 16)
    p2 = p1.clone()
    o1 = da.kda_step(*xs16, p1, state_indices=idx, use_qk_l2norm=True, backend="triton")
    o2 = da.kda_step(*xs16, p2, state_indices=idx, use_qk_l2norm=True, backend="torch")
    torch.testing.assert_close(o1, o2, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(p1, p2, atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------------------------
# capability errors, custom op fake implementation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("K,V", [(40, 16), (16, 272)])
def test_unsupported_head_dim_is_a_named_error(K, V):
    xs, _ = make(1, 3, 1, 1, K, V, torch.float32)
    with pytest.raises(UnsupportedError, match="head dim"):
        da.kda(*xs, backend="triton")


def test_fake_implementation_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from delta_attn.ops.kda import triton_impl  # noqa: F401  (registers the custom ops)
    with FakeTensorMode():
        q = torch.empty(1, 50, 2, 32)
        v = torch.empty(1, 50, 4, 16)
        g = torch.empty(1, 50, 4, 32)
        beta = torch.empty(1, 50, 4)
        cu = torch.empty(4, dtype=torch.int32)
        o, s = torch.ops.delta_attn.kda_chunk_fwd(q, q, v, g, beta, None, cu, None, None, 0.1, None, True, True)
        assert o.shape == (1, 50, 4, 16) and s.shape == (3, 4, 32, 16) and s.dtype == torch.float32


@pytest.mark.parametrize("factor_max", [-1.0, 1e9])
def test_pairwise_and_factored_paths(monkeypatch, factor_max, train16):
    """Each chunk takes the factored path (every |G| <= factor_max) or the exact pairwise one:
    force each in turn (1e9 would overflow on strong decays; the default 60 never does)."""
    from delta_attn.ops.kda import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "factor_max", factor_max)
    xs, kw = make(1, 35, 1, 2, 16, 16, torch.float32, gate="softplus", h0=True)
    check_all(xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)


def test_custom_op_path_matches_eager(monkeypatch, train16):
    """The torch.compile path (custom op, backward recomputes) == the eager autograd Function
    (backward from the saved intermediates)."""
    from delta_attn.ops.kda import triton_impl
    xs, kw = make(1, 21, 1, 2, 16, 16, torch.float32, h0=True)
    eager = run("triton", xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = run("triton", xs, kw, grad=True, use_qk_l2norm=True, output_final_state=True)
    for a, b in zip([eager[0], eager[1]] + eager[2], [traced[0], traced[1]] + traced[2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
