"""Gated diagonal attention, Triton backend, on a CUDA GPU: many tiles in flight, so the decoupled
look-back really composes published aggregates (the interpreter runs programs one by one).

Large cases use the log-depth scan reference (``delta_attn.reference.gated_diag_scan``) in float64 as the ground
truth and the same scan in float32 (the kernel's state precision), rounded to the input dtype, as
the baseline of the error rule.
"""
import pytest
import torch

import delta_attn as da
from delta_attn import reference
from delta_attn.reference import gated_diag_scan
from delta_attn.testing import assert_close, poison_outputs

DEV = "cuda"


def _inputs(b, t, h, d, dtype, g_dtype=None, lo=-1.0):
    q, k, v = (torch.randn(b, t, h, d, device=DEV).to(dtype) for _ in range(3))
    g = (torch.rand(b, t, h, d, device=DEV) * lo).to(g_dtype or dtype)
    return q, k, v, g


def _run(q, k, v, g, h0, cu, do, dht):
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]
    s0 = h0.detach().requires_grad_() if h0 is not None else None
    with poison_outputs():
        o, ht = da.gated_diag_attn(*leaves, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                                   backend="triton")
        torch.autograd.backward((o, ht), (do, dht))
    return o, ht, [x.grad for x in leaves] + ([s0.grad] if s0 is not None else [])


def _check_against_scan(q, k, v, g, h0=None, cu=None, grads=True):
    n = cu.shape[0] - 1 if cu is not None else q.shape[0]
    do = torch.randn_like(q)
    dht = torch.randn(n, q.shape[2], q.shape[3], device=DEV)
    o, ht, ours = _run(q, k, v, g, h0, cu, do, dht)
    o64, ht64, g64 = gated_diag_scan(q, k, v, g, h0, cu, do, dht)
    o32, ht32, g32 = gated_diag_scan(q, k, v, g, h0, cu, do, dht, dtype=torch.float32)
    assert_close(o, o64, o32.to(q.dtype), name="o")
    assert_close(ht, ht64, ht32, name="final_state")
    if grads:
        names = ["dq", "dk", "dv", "dg", "d_initial_state"]
        dts = [q.dtype, q.dtype, q.dtype, g.dtype, torch.float32]
        for name, x, r64, r32, dt in zip(names, ours, g64, g32, dts):
            assert x.dtype == dt, name
            assert_close(x, r64, r32.to(dt), kind="grad", name=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_against_spec_small(dtype):
    # against the loop specification itself (input-dtype loop as the baseline), odd sizes
    q, k, v, g = _inputs(2, 131, 3, 96, dtype, torch.float32 if dtype != torch.float32 else None)
    h0 = torch.randn(2, 3, 96, device=DEV)
    do, dht = torch.randn_like(q), torch.randn(2, 3, 96, device=DEV)
    o, ht, ours = _run(q, k, v, g, h0, None, do, dht)

    def spec(upcast):
        cast = (lambda x: x.double()) if upcast else (lambda x: x)
        leaves = [cast(x).detach().requires_grad_() for x in (q, k, v, g, h0)]
        ro, rh = reference.gated_diag(*leaves[:4], initial_state=leaves[4], output_final_state=True, upcast=upcast)
        torch.autograd.backward((ro, rh), (cast(do).to(ro.dtype), cast(dht).to(rh.dtype)))
        return ro, rh, [x.grad for x in leaves]
    o64, h64, g64 = spec(True)
    olp, hlp, glp = spec(False)
    assert_close(o, o64, olp)
    assert_close(ht, h64, hlp)
    for x, r64, rlp in zip(ours, g64, glp):
        assert_close(x, r64, rlp, kind="grad")


@pytest.mark.parametrize("b,t,h,d", [(8, 4096, 4, 128), (1, 32768, 2, 48), (3, 1025, 16, 96)])
def test_many_tiles(b, t, h, d):
    q, k, v, g = _inputs(b, t, h, d, torch.bfloat16, lo=-0.05)
    _check_against_scan(q, k, v, g, torch.randn(b, h, d, device=DEV))


def test_varlen_zero_length_many_tiles():
    lens = [0, 3000, 0, 1, 777, 12000, 0, 64, 5000, 0]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q, k, v, g = _inputs(1, int(cu[-1]), 4, 128, torch.bfloat16, torch.float32, lo=-0.1)
    _check_against_scan(q, k, v, g, torch.randn(len(lens), 4, 128, device=DEV), cu)


def test_extreme_decays():
    q, k, v, g = _inputs(2, 20000, 4, 128, torch.float16, torch.float32, lo=-0.01)
    g = torch.where(torch.rand_like(g) < 0.05, torch.full_like(g, -1e4), g)
    g[:, 5000:7000] = -1e4
    _check_against_scan(q, k, v, g, torch.randn(2, 4, 128, device=DEV))


def test_one_million_tokens():
    # 1M tokens with long memory (decays in [-0.02, 0]): float32 carries stay within tolerance
    q, k, v, g = _inputs(1, 1 << 20, 1, 128, torch.bfloat16, lo=-0.02)
    _check_against_scan(q, k, v, g, torch.randn(1, 1, 128, device=DEV))


def test_repeatable_and_two_halves():
    q, k, v, g = _inputs(2, 50000, 16, 128, torch.bfloat16, lo=-0.05)
    h0 = torch.randn(2, 16, 128, device=DEV)
    o, ht = da.gated_diag_attn(q, k, v, g, initial_state=h0, output_final_state=True, backend="triton")
    for _ in range(3):   # the look-back composes in a run-dependent order: equal up to rounding
        o2, ht2 = da.gated_diag_attn(q, k, v, g, initial_state=h0, output_final_state=True, backend="triton")
        torch.testing.assert_close(o2, o, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(ht2, ht, rtol=1e-4, atol=1e-4)
    half = 23457
    o1, h1 = da.gated_diag_attn(q[:, :half], k[:, :half], v[:, :half], g[:, :half], initial_state=h0,
                                output_final_state=True, backend="triton")
    o2, h2 = da.gated_diag_attn(q[:, half:], k[:, half:], v[:, half:], g[:, half:], initial_state=h1,
                                output_final_state=True, backend="triton")
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(h2, ht, rtol=1e-4, atol=1e-4)


def test_step_pool_in_place():
    b, t, h, d = 64, 5, 16, 128
    q, k, v, g = _inputs(b, t, h, d, torch.bfloat16, torch.float32)
    h0 = torch.randn(b, h, d, device=DEV)
    o, ht = da.gated_diag_attn(q, k, v, g, initial_state=h0, output_final_state=True, backend="triton")
    pool = torch.randn(100, h, d, device=DEV)
    idx = torch.randperm(100, device=DEV)[:b]
    pool[idx] = h0
    rest = torch.ones(100, dtype=torch.bool, device=DEV)
    rest[idx] = False
    untouched = pool[rest].clone()
    outs = [da.gated_diag_step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1], pool,
                               state_indices=idx, backend="triton") for i in range(t)]
    torch.testing.assert_close(torch.cat(outs, 1), o, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(pool[idx], ht, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[rest], untouched)


def test_compile_fullgraph():
    q, k, v, g = _inputs(2, 999, 4, 64, torch.bfloat16)
    q.requires_grad_()

    def f(q, k, v, g):
        o, ht = da.gated_diag_attn(q, k, v, g, output_final_state=True, backend="triton")
        return o.float().sum() + ht.sum()

    y = torch.compile(f, fullgraph=True)(q, k, v, g)
    y.backward()
    gq = q.grad.clone()
    q.grad = None
    y2 = f(q, k, v, g)
    y2.backward()
    torch.testing.assert_close(y, y2, rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(gq, q.grad, rtol=1e-2, atol=1e-2)


# Launch shapes the code picks besides the bar shape's: problems too small to fill the GPU twice with the
# default channel blocks get smaller blocks (and, with them, fewer warps: no more than the block's vector
# fills). Long chains all the same: hundreds of tiles of one chain in flight race through the look-back.
SHRUNK_LENS = [0, 3000, 0, 1, 777, 4000, 0, 64, 1500, 0]


def _shrunk_cases():
    """((q, k, v, g), initial state, cu_seqlens), each with its blocks shrunk: fixed length, H * D = 32
    (the EVEN path; 200 forward tiles per chain), and varlen with empty sequences and a run of full
    decays, H * D = 48 (masked rows and channels; 146 forward tiles per chain)."""
    cu = torch.tensor([0] + torch.tensor(SHRUNK_LENS).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    cases = [(_inputs(1, 12800, 1, 32, torch.bfloat16, lo=-0.05), torch.randn(1, 1, 32, device=DEV), None),
             (_inputs(1, int(cu[-1]), 1, 48, torch.bfloat16, torch.float32, lo=-0.1),
              torch.randn(len(SHRUNK_LENS), 1, 48, device=DEV), cu)]
    cases[1][0][3][:, 4000:4100] = -1e4
    return cases


def _assert_blocks_shrink(q):
    """The case really runs shrunk forward blocks (the launcher's choice on this GPU)."""
    import triton
    from delta_attn.ops.diag import launch as ti
    total, hd, bd = q.shape[0] * q.shape[1], q.shape[2] * q.shape[3], ti.FWD_CONFIG.bd
    assert ti._block_hd(bd, triton.cdiv(total, ti.FWD_CONFIG.bt), hd, q.device) < min(bd, triton.next_power_of_2(hd))


def test_shrunk_blocks_many_tiles():
    # the configs the launcher picks for small problems (shrunk channel blocks, fewer warps): training
    # forward + backward against the float64 scan, and the inference forward (no carries) equal to it
    for (q, k, v, g), h0, c in _shrunk_cases():
        _assert_blocks_shrink(q)
        _check_against_scan(q, k, v, g, h0, c)
        o64, ht64, _ = gated_diag_scan(q, k, v, g, h0, c)
        o32, ht32, _ = gated_diag_scan(q, k, v, g, h0, c, dtype=torch.float32)
        with torch.no_grad(), poison_outputs():
            o, ht = da.gated_diag_attn(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=c,
                                       backend="triton")
        assert_close(o, o64, o32.to(q.dtype), name="o (inference forward)")
        assert_close(ht, ht64, ht32, name="final_state (inference forward)")


# ---- non-finite gates (issue 15): a NaN stays in its own sequence with thousands of tiles in flight ----
# (the checks are tests/diag_nan_checks.py's, the semantics tests/ops/test_diag_nan.py's; here the look-back
# really races: a tile may meet its predecessor's aggregate map, a full decay or a reset, before the inclusive state)

from diag_nan_checks import (check_nan_run, check_step_nan, check_step_strided_indices,  # noqa: E402
                             nan_case, public_with_grads)

NAN_LENS = [0, 3000, 0, 1, 777, 12000, 0, 64, 5000, 0]
# NaN rows: inside a long sequence (then 2000 full decays), at a first token, and near the end of one
# whose next sequence starts right after
NAN_AT = [(1, 1500), (7, 0), (4, 770)]


def _scan_ref(q, k, v, g, h0, cu, do, dht, upcast):
    """The log-depth scan reference: float64 (upcast), or float32 (the kernels' state precision) rounded to
    the outputs' dtypes (the error rule's baseline)."""
    o, ht, grads = gated_diag_scan(q, k, v, g, h0, cu, do, dht, dtype=torch.float64 if upcast else torch.float32)
    grads = [x for x in grads if x is not None]
    if not upcast:
        o = o.to(q.dtype)
        grads = [x.to(dt) for x, dt in zip(grads, [q.dtype, q.dtype, q.dtype, g.dtype, torch.float32])]
    return o, ht, grads


@pytest.mark.parametrize("dtype,g_dtype,h0", [(torch.bfloat16, torch.float32, True),
                                              (torch.bfloat16, torch.bfloat16, False),
                                              (torch.float16, torch.float16, True),
                                              (torch.float32, None, False)])
def test_varlen_nan_stays_in_its_sequence_many_tiles(dtype, g_dtype, h0):
    q, k, v, g, s0, cu = nan_case(NAN_LENS, 4, 128, dtype, g_dtype, nan_at=NAN_AT, full_decay=2000, h0=h0,
                                  lo=-0.1)
    check_nan_run(public_with_grads("triton"), _scan_ref, q, k, v, g, s0, cu, NAN_AT)


def test_batch_nan_stays_in_its_sequence_many_tiles():
    # fixed length, the mask-free EVEN path (T and H * D multiples of the tiles): row 1's NaN must reach
    # neither row 2 (forward) nor row 0 (backward)
    q, k, v, g = _inputs(4, 8192, 16, 128, torch.bfloat16, torch.float32, lo=-0.05)
    g[1, 3000] = float("nan")
    g[1, 3001:5000] = -1e4
    check_nan_run(public_with_grads("triton"), _scan_ref, q, k, v, g, torch.randn(4, 16, 128, device=DEV), None,
                  [(1, 3000)], t_seq=8192)


def test_shrunk_blocks_nan_many_tiles():
    # the varlen NaN case at the shrunk-block shape (forward 32-channel blocks over H * D = 48)
    q, k, v, g, s0, cu = nan_case(SHRUNK_LENS, 1, 48, torch.bfloat16, torch.float32, nan_at=NAN_AT, full_decay=2000,
                                  lo=-0.1)
    _assert_blocks_shrink(q)
    check_nan_run(public_with_grads("triton"), _scan_ref, q, k, v, g, s0, cu, NAN_AT)


def test_step_nan_and_strided_state_indices():
    check_step_nan("triton", device=DEV)
    for idx_dtype in (torch.int32, torch.int64):
        check_step_strided_indices("triton", idx_dtype, device=DEV)
