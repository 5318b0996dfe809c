"""Gated diagonal attention on the Triton backend, run by the interpreter on CPU.

Tiny sizes with odd lengths and a head dim that is not a power of two (boundary masks); the
interpreter's tiles are BT = 8 (forward) / 16 (backward) rows and 16 channels, so T = 37 spans
several tiles and the look-back; D = 20 spans a full and a masked channel block.
"""
import pytest
import torch
import triton
import triton.language as tl

import delta_attn as da
from delta_attn import reference
from delta_attn.testing import assert_close
from delta_attn.ops import _launch  # noqa: F401  (applies the interpreter fixes: a probe kernel below is launched directly)
from delta_attn.ops.diag import kernels_scan as K

pytestmark = pytest.mark.skipif(not da.backends.triton_interpreter_on() and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter or a GPU")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b, t, h, d, dtype, g_dtype=None, decay_scale=1.0):
    q, k, v = (torch.randn(b, t, h, d, device=DEV).to(dtype) for _ in range(3))
    g = (-torch.rand(b, t, h, d, device=DEV) * decay_scale).to(g_dtype or dtype)
    return q, k, v, g


def _ref(q, k, v, g, h0, cu, do, dht, upcast):
    """Reference outputs and gradients; upcast=True runs in float64, False in the input dtype."""
    cast = (lambda x: x.double()) if upcast else (lambda x: x)
    leaves = [cast(x).detach().requires_grad_() for x in (q, k, v, g)]
    s0 = cast(h0).detach().requires_grad_() if h0 is not None else None
    o, ht = reference.gated_diag(*leaves, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                                 upcast=upcast)
    torch.autograd.backward((o, ht), (cast(do).to(o.dtype), cast(dht).to(ht.dtype)))
    grads = [x.grad for x in leaves] + ([s0.grad] if s0 is not None else [])
    return o, ht, grads


def _check_all(q, k, v, g, h0=None, cu=None):
    qs, ks, vs, gs = (x.detach().requires_grad_() for x in (q, k, v, g))
    s0 = h0.detach().requires_grad_() if h0 is not None else None
    o, ht = da.gated_diag_attn(qs, ks, vs, gs, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                               backend="triton")
    assert o.dtype == q.dtype and ht.dtype == torch.float32
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    torch.autograd.backward((o, ht), (do, dht))
    o64, ht64, g64 = _ref(q, k, v, g, h0, cu, do, dht, True)
    olp, htlp, glp = _ref(q, k, v, g, h0, cu, do, dht, False)
    assert_close(o, o64, olp, name="o")
    assert_close(ht, ht64, htlp, name="final_state")
    names = ["dq", "dk", "dv", "dg"] + (["d_initial_state"] if h0 is not None else [])
    ours = [qs.grad, ks.grad, vs.grad, gs.grad] + ([s0.grad] if h0 is not None else [])
    for name, x, r64, rlp in zip(names, ours, g64, glp):
        assert x.dtype == (h0.dtype if name == "d_initial_state" else rlp.dtype), name
        assert_close(x, r64, rlp, kind="grad", name=name)
    return o, ht


@pytest.mark.parametrize("dtype,g_dtype", [(torch.float32, None), (torch.float16, torch.float32)])
def test_fwd_bwd_states(poisoned, dtype, g_dtype):
    q, k, v, g = _inputs(2, 37, 2, 20, dtype, g_dtype)
    h0 = torch.randn(2, 2, 20, device=DEV)
    _check_all(q, k, v, g, h0)


def test_no_states_odd_sizes(poisoned):
    # T = 1 and T = 17 with D = 5 (one masked channel block), no initial state
    for t in (1, 17):
        q, k, v, g = _inputs(3, t, 1, 5, torch.float16)
        o, _ = da.gated_diag_attn(q, k, v, g, backend="triton")
        o64, _ = reference.gated_diag(q, k, v, g)
        olp, _ = reference.gated_diag(q, k, v, g, upcast=False)
        assert_close(o, o64, olp)


def test_varlen_zero_length(poisoned):
    # zero-length sequences first, in the middle and last; a length-1 sequence; tiles straddle sequences
    cu = torch.tensor([0, 0, 5, 5, 22, 23, 40, 40], dtype=torch.int32, device=DEV)
    q, k, v, g = _inputs(1, 40, 2, 20, torch.float32)
    h0 = torch.randn(7, 2, 20, device=DEV)
    o, ht = _check_all(q, k, v, g, h0, cu)
    # an empty sequence's final state is its initial state
    torch.testing.assert_close(ht[[0, 2, 6]], h0[[0, 2, 6]], rtol=0, atol=0)
    # varlen == the per-sequence loop
    for n in range(7):
        a, b = int(cu[n]), int(cu[n + 1])
        if a == b:
            continue
        on, hn = da.gated_diag_attn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], initial_state=h0[n:n + 1],
                                    output_final_state=True, backend="triton")
        torch.testing.assert_close(on, o[:, a:b], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hn, ht[n:n + 1], rtol=1e-5, atol=1e-5)
    # no initial state: an empty sequence ends in state 0
    _, ht0 = da.gated_diag_attn(q, k, v, g, output_final_state=True, cu_seqlens=cu, backend="triton")
    assert torch.count_nonzero(ht0[[0, 2, 6]]) == 0


def test_extreme_decays(poisoned):
    # decays down to -1e4 (exp underflows to exactly 0) mixed with tiny ones: no NaN / inf
    q, k, v, g = _inputs(1, 37, 1, 20, torch.float32)
    g = torch.where(torch.rand_like(g) < 0.3, torch.full_like(g, -1e4), g * 1e-3)
    g[:, 8:16] = -1e4                        # a whole tile fully decayed
    _check_all(q, k, v, g, torch.randn(1, 1, 20, device=DEV))


def test_two_halves_equal_one_pass(poisoned):
    q, k, v, g = _inputs(2, 37, 1, 20, torch.float32)
    h0 = torch.randn(2, 1, 20, device=DEV)
    o, ht = da.gated_diag_attn(q, k, v, g, initial_state=h0, output_final_state=True, backend="triton")
    o1, h1 = da.gated_diag_attn(q[:, :19], k[:, :19], v[:, :19], g[:, :19], initial_state=h0,
                                output_final_state=True, backend="triton")
    o2, h2 = da.gated_diag_attn(q[:, 19:], k[:, 19:], v[:, 19:], g[:, 19:], initial_state=h1,
                                output_final_state=True, backend="triton")
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2, ht, rtol=1e-5, atol=1e-5)


def test_step_token_by_token_equals_whole(poisoned):
    b, t, h, d = 3, 6, 2, 20
    q, k, v, g = _inputs(b, t, h, d, torch.float16, torch.float32)
    h0 = torch.randn(b, h, d, device=DEV)
    o, ht = da.gated_diag_attn(q, k, v, g, initial_state=h0, output_final_state=True, backend="triton")
    pool = torch.randn(5, h, d, device=DEV)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
    pool[idx.long()] = h0
    untouched = pool[[1, 3]].clone()
    steps = [da.gated_diag_step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1], pool,
                                state_indices=idx, backend="triton") for i in range(t)]
    torch.testing.assert_close(torch.cat(steps, 1), o, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(pool[idx.long()], ht, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[[1, 3]], untouched)
    # several tokens per call, no indices: the same recurrence
    pool2 = h0.clone()
    o2 = da.gated_diag_step(q, k, v, g, pool2, backend="triton")
    o64, ht64 = reference.gated_diag(q, k, v, g, initial_state=h0, output_final_state=True)
    olp, _ = reference.gated_diag(q, k, v, g, initial_state=h0, output_final_state=True, upcast=False)
    assert_close(o2, o64, olp)
    torch.testing.assert_close(pool2, ht64, rtol=1e-5, atol=1e-5)


@triton.jit
def _lookback_probe_kernel(ws, out, j, n_tiles, D, REVERSE: tl.constexpr, BD: tl.constexpr, W: tl.constexpr):
    cols = tl.arange(0, BD)
    cmask = cols < D
    x = K._lookback_walk(ws, j, cols, cmask, D, n_tiles, REVERSE, W)
    tl.store(out + cols, x, mask=cmask)


def _pack(a, b):
    a_bits = a.float().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    b_bits = b.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return (a_bits << 32) | b_bits | K.INCL_ZERO


@pytest.mark.parametrize("reverse,w", [(False, 2), (True, 2), (False, 3), (True, 3)])
def test_lookback_composes_aggregates(reverse, w):
    # On the interpreter every predecessor has already published its inclusive state, so the
    # aggregate path of the look-back is exercised here directly: 11 tiles of published maps
    # (A, B), some with A == 0 (inclusive), composed across several windows of W words (channels
    # stop at different tiles).
    n_tiles, d = 11, 5
    a = torch.rand(n_tiles, d, device=DEV) + 0.5
    b = torch.randn(n_tiles, d, device=DEV)
    a[3, 1] = 0.0
    a[7, 2] = 0.0
    ws = _pack(a, b)
    for j in (0, 5, 10):
        out = torch.full((d,), float("nan"), device=DEV)
        _lookback_probe_kernel[(1,)](ws, out, j, n_tiles, d, REVERSE=reverse, BD=8, W=w)
        expect = torch.zeros(d, dtype=torch.float64, device=DEV)
        order = range(j + 1, n_tiles) if reverse else range(0, j)
        for t in (reversed(list(order)) if reverse else order):   # apply the farthest map first
            expect = a[t].double() * expect + b[t].double()
        torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)


def test_dispatch_and_compile():
    q, k, v, g = _inputs(1, 9, 1, 8, torch.float32)
    assert da.explain(da.gated_diag_attn, q, k, v, g).chosen == "triton"
    assert da.explain(da.gated_diag_attn, q.double(), k.double(), v.double(), g.double()).chosen == "torch"

    def f(q, k, v, g):
        return da.gated_diag_attn(q, k, v, g, output_final_state=True, backend="triton")

    o, ht = torch.compile(f, fullgraph=True, backend="eager")(q, k, v, g)
    o2, ht2 = f(q, k, v, g)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht2, rtol=0, atol=0)


def test_custom_op_fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from delta_attn.ops.diag import launch as ti
    q, k, v, g = _inputs(1, 13, 2, 20, torch.float16, torch.float32)
    h0 = torch.randn(1, 2, 20, device=DEV)
    real = torch.ops.delta_attn.diag_fwd(q, k, v, g, h0, None, True)
    with FakeTensorMode() as mode:
        fq, fk, fv, fg, fh = (mode.from_tensor(x) for x in (q, k, v, g, h0))
        fake = torch.ops.delta_attn.diag_fwd(fq, fk, fv, fg, fh, None, True)
        fb = torch.ops.delta_attn.diag_bwd(fq, fk, fv, fg, fq, fake[2], fh, fake[1], None)
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.dtype == f.dtype
    rb = ti.diag_bwd(q, k, v, g, q, real[2], h0, real[1], None)
    for r, f in zip(rb, fb):
        assert r.shape == f.shape and r.dtype == f.dtype


def test_scan_reference_matches_spec():
    # the log-depth scan reference (used on the GPU for 1M tokens) == autograd through the spec
    from delta_attn.reference import gated_diag_scan
    cu = torch.tensor([0, 0, 5, 5, 22, 23, 40, 40], dtype=torch.int32, device=DEV)
    q, k, v, g = (x.double() for x in _inputs(1, 40, 2, 3, torch.float32))
    g[0, 7] = -1e4
    h0 = torch.randn(7, 2, 3, device=DEV, dtype=torch.float64)
    do, dht = torch.randn_like(q), torch.randn_like(h0)
    for c, s0 in ((cu, h0), (None, h0[:1]), (None, None)):
        o64, ht64, g64 = _ref(q, k, v, g, s0, c, do, dht[:s0.shape[0]] if s0 is not None else dht[:1], True)
        o, ht, grads = gated_diag_scan(q, k, v, g, s0, c, do, dht[:ht64.shape[0]])
        torch.testing.assert_close(o, o64)
        torch.testing.assert_close(ht, ht64.double())
        for x, r in zip(grads, g64):
            torch.testing.assert_close(x, r)


def _fwd_bwd(q, k, v, g, h0, cu, do, dht, fcfg, bcfg):
    """The training forward with ``fcfg`` (o, final state, carries every segment_rows rows) and the
    backward with ``bcfg`` on its carries."""
    from delta_attn.ops.diag import launch as ti
    o, ht, ws = ti.diag_fwd(q, k, v, g, h0, cu, True, config=fcfg, training=True)
    assert ws.shape[0] == triton.cdiv(q.shape[0] * q.shape[1], fcfg.bt) * fcfg.split
    grads = ti.diag_bwd(q, k, v, g, do, ws, h0, dht, cu, config=bcfg, fwd_bt=fcfg.segment_rows)
    return o, ht, grads


def _check_fwd_bwd(q, k, v, g, h0, cu, fcfg, bcfg):
    """The training forward and the backward with explicit configs against the float64 reference; the
    inference forward (no carries) gives the same o and final state."""
    from delta_attn.ops.diag import launch as ti
    n = cu.shape[0] - 1 if cu is not None else q.shape[0]
    do, dht = torch.randn_like(q), torch.randn(n, q.shape[2], q.shape[3], device=DEV)
    o, ht, grads = _fwd_bwd(q, k, v, g, h0, cu, do, dht, fcfg, bcfg)
    o64, ht64, g64 = _ref(q, k, v, g, h0, cu, do, dht, True)
    olp, htlp, glp = _ref(q, k, v, g, h0, cu, do, dht, False)
    assert o.dtype == q.dtype and ht.dtype == torch.float32
    assert_close(o, o64, olp, name="o")
    assert_close(ht, ht64, htlp, name="final_state")
    for name, x, r64, rlp in zip(["dq", "dk", "dv", "dg", "dh0"], grads, g64, glp):
        assert_close(x, r64, rlp, kind="grad", name=name)
    with da.testing.poison_outputs():
        oi, hti, _ = ti.diag_fwd(q, k, v, g, h0, cu, True, config=fcfg)
    torch.testing.assert_close(oi, o, rtol=0, atol=0)
    torch.testing.assert_close(hti, ht, rtol=0, atol=0)
    return o, ht, grads


@pytest.mark.parametrize("t,d", [(128, 16), (133, 20)])
def test_gpu_configs(poisoned, t, d):
    # the GPU's configs (forward: 64-row tiles walked as 4 segments, window 4; backward: 16-row tiles on
    # the forward's 16-row carries, window 8) run by the interpreter, 2-3 forward tiles per sequence. T = 128,
    # H * D = 32: the mask-free EVEN path; T = 133, H * D = 40: masked rows and channels
    from delta_attn.ops.diag import launch as ti
    q, k, v, g = _inputs(2, t, 2, d, torch.float16, torch.float32, decay_scale=0.1)
    _check_fwd_bwd(q, k, v, g, torch.randn(2, 2, d, device=DEV), None, ti.FWD_CONFIG, ti.BWD_CONFIG)


@pytest.mark.parametrize("t,d,bt,split", [(37, 20, 8, 2), (32, 32, 16, 4), (37, 20, 16, 4)])
def test_tile_sizes_against_float64(poisoned, t, d, bt, split):
    # other tile sizes of the same kernels: segments of 4 rows, a 16-row backward on 4-row carries; odd
    # length (masked rows, a channel block straddling the two heads: H * D = 40) and the EVEN path
    # (T % BT == 0, H * D % BD == 0); fp16 inputs with fp32 decays; initial and final states
    from delta_attn.ops.diag import launch as ti
    q, k, v, g = _inputs(2, t, 2, d, torch.float16, torch.float32)
    _check_fwd_bwd(q, k, v, g, torch.randn(2, 2, d, device=DEV), None, ti.FwdConfig(bt, 16, 2, 2, split),
                   ti.BwdConfig(16, 16, 2, 1))


def test_configs_are_validated():
    from delta_attn.ops.diag import launch as ti
    for split in (1, 3, 16):
        with pytest.raises(ValueError, match="split"):
            ti.FwdConfig(8, 16, 2, 2, split)
    q, k, v, g = _inputs(1, 16, 1, 16, torch.float32)
    _, _, ws = ti.diag_fwd(q, k, v, g, training=True)
    with pytest.raises(ValueError, match="multiple of the forward's carry rows"):
        ti.diag_bwd(q, k, v, g, q, ws, config=ti.BwdConfig(2, 16, 2, 1))


def test_varlen_zero_length_and_extreme_decays_split_segments(poisoned):
    # varlen with zero-length sequences (first, middle, last), a length-1 sequence, tiles and segments
    # straddling sequences; decays down to -1e4 including a fully decayed tile
    from delta_attn.ops.diag import launch as ti
    cu = torch.tensor([0, 0, 5, 5, 22, 23, 40, 40], dtype=torch.int32, device=DEV)
    q, k, v, g = _inputs(1, 40, 2, 20, torch.float32)
    g = torch.where(torch.rand_like(g) < 0.3, torch.full_like(g, -1e4), g)
    g[:, 8:16] = -1e4
    h0 = torch.randn(7, 2, 20, device=DEV)
    o, ht, grads = _check_fwd_bwd(q, k, v, g, h0, cu, ti.FwdConfig(16, 16, 2, 2, split=4), ti.BwdConfig(16, 16, 2, 1))
    for x in (o, ht) + tuple(grads):
        assert torch.isfinite(x).all()
    torch.testing.assert_close(ht[[0, 2, 6]], h0[[0, 2, 6]], rtol=0, atol=0)
    # no initial state: an empty sequence ends in state 0. A training forward writes its carries every
    # segment (16-row tiles as 2 segments: every 8 rows): the inference forward's 8-row tile words
    fcfg = ti.INTERP_FWD_CONFIG
    _, ht3, ws3 = ti.diag_fwd(q, k, v, g, None, cu, True, config=fcfg)
    assert torch.count_nonzero(ht3[[0, 2, 6]]) == 0
    assert ws3.shape[0] == 5 and bool((ws3 < 0).all())   # every tile published its inclusive word
    _, _, ws4 = ti.diag_fwd(q, k, v, g, None, cu, True, config=ti.FwdConfig(16, 16, 2, 2, split=2), training=True)
    assert ws4.shape[0] == 6 and bool((ws4 < 0).all())
    c3 = (ws3 & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    c4 = (ws4[:5] & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    torch.testing.assert_close(c4, c3, rtol=1e-5, atol=1e-5)


def test_step_with_a_strided_state_indices_view_touches_only_its_slots():
    """A strided state_indices view (every other element of a longer tensor) updates exactly the
    slots it names, as its contiguous copy does (the kernel reads idx + b)."""
    import delta_attn as da
    torch.manual_seed(3)
    b, h, d, pool = 3, 2, 16, 8
    q, k, v = (torch.randn(b, 1, h, d) for _ in range(3))
    g = -torch.rand(b, 1, h, d)
    base = torch.randn(pool, h, d)
    wide = torch.tensor([5, 0, 1, 0, 6, 0], dtype=torch.int32)
    idx = wide[::2]                                     # [5, 1, 6], stride 2
    assert idx.stride(0) == 2
    s_view, s_copy = base.clone(), base.clone()
    o1 = da.gated_diag_step(q, k, v, g, s_view, state_indices=idx, backend="triton")
    o2 = da.gated_diag_step(q, k, v, g, s_copy, state_indices=idx.contiguous(), backend="torch")
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_view, s_copy, rtol=1e-5, atol=1e-5)
    untouched = [i for i in range(pool) if i not in (5, 1, 6)]
    assert torch.equal(s_view[untouched], base[untouched])
