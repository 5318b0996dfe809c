"""Non-finite gates in gated diagonal attention: a NaN stays in its own sequence (issue 15).

The semantics (``da.gated_diag_attn``'s docstring, docs/ARCHITECTURE.md): the recurrence is evaluated as
written, sequence by sequence. A NaN in g at token p of sequence n makes that sequence's state NaN from p
on: its outputs from p on and its final state (``exp(NaN) s``; a full decay after it does not wash it
out, ``0 * NaN = NaN``; a NaN at a first token with no initial state gives ``exp(NaN) * 0 = NaN``).
Every other sequence of the batch is computed exactly as without it: a sequence start selects the
state, it never multiplies the previous sequence's by 0. Gradients are NaN exactly where autograd
through the float64 specification gives NaN, which is inside the NaN sequence only.

CPU: the Triton interpreter (the interpreter's configs and the GPU's) and backend="torch". The checks are
tests/diag_nan_checks.py's; tests/gpu/test_diag_gpu.py runs them with thousands of tiles in flight.
"""
import pytest
import torch
import triton
import triton.language as tl

import delta_attn as da
from delta_attn.ops.diag import kernels_scan as K

from diag_nan_checks import (DEV, check_nan_run, check_step_nan, check_step_strided_indices, launchers_with_grads,
                             nan_case, public_with_grads, spec_with_grads)

BACKENDS = ["triton", "torch"]

pytestmark = pytest.mark.skipif(not da.backends.triton_interpreter_on() and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter or a GPU")


# ---- the cases ---------------------------------------------------------------------------------------
# interpreter tiles: the forward 8 rows (2 segments of 4), the backward 16, channel blocks of 16 over H * D = 40

CASES = {
    # the NaN sequence (1) ends inside a tile: the next sequence starts mid-tile, an empty one between
    "boundary_mid_tile": dict(lens=[5, 13, 0, 9, 14], nan_at=[(1, 2)]),
    # the NaN sequence ends at a tile's last row: the next one starts a tile (reached by the look-back)
    "boundary_at_tile": dict(lens=[3, 13, 8, 15], nan_at=[(1, 4)]),
    # a NaN at a sequence's first token, no initial state (exp(NaN) * 0), then 9 full decays (0 * NaN)
    "first_token_full_decay": dict(lens=[6, 12, 21], nan_at=[(1, 0)], full_decay=9, h0=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_nan_stays_in_its_sequence(backend, dtype, case):
    c = dict(CASES[case])
    lens, nan_at = c.pop("lens"), c.pop("nan_at")
    q, k, v, g, h0, cu = nan_case(lens, 2, 20, dtype, nan_at=nan_at, **c)
    check_nan_run(public_with_grads(backend), spec_with_grads, q, k, v, g, h0, cu, nan_at)


@pytest.mark.parametrize("t", [16, 13])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_nan_stays_in_its_sequence(backend, t):
    # fixed length: T = 16 takes the mask-free EVEN path (T, H * D multiples of the tiles), 13 the masked one;
    # the NaN in batch row 1 must reach neither row 2 (forward) nor row 0 (backward)
    q, k, v = (torch.randn(3, t, 2, 8, device=DEV) for _ in range(3))
    g = -torch.rand(3, t, 2, 8, device=DEV)
    g[1, 5] = float("nan")
    h0 = torch.randn(3, 2, 8, device=DEV)
    check_nan_run(public_with_grads(backend), spec_with_grads, q, k, v, g, h0, None, [(1, 5)], t_seq=t)


def test_gpu_configs_nan():
    # the GPU's configs (64-row forward tiles as 4 segments of 16 rows, 16-row backward tiles) run by the
    # interpreter: a varlen batch whose sequences end mid-tile and mid-segment, an empty one between, the
    # NaN sequence (1) followed by full decays; and a fixed-length batch of one tile per sequence (the
    # EVEN path), the NaN in row 1 reaching neither row 2 (forward) nor row 0 (backward)
    from delta_attn.ops.diag import launch as ti
    run = launchers_with_grads(ti.FWD_CONFIG, ti.BWD_CONFIG, training=True)
    lens, nan_at = [40, 70, 0, 9, 81], [(1, 20)]
    q, k, v, g, h0, cu = nan_case(lens, 1, 8, torch.float32, nan_at=nan_at, full_decay=30, lo=-0.1)
    check_nan_run(run, spec_with_grads, q, k, v, g, h0, cu, nan_at)
    q, k, v = (torch.randn(3, 64, 1, 8, device=DEV) for _ in range(3))
    g = -torch.rand(3, 64, 1, 8, device=DEV) * 0.1
    g[1, 40] = float("nan")
    check_nan_run(run, spec_with_grads, q, k, v, g, torch.randn(3, 1, 8, device=DEV), None, [(1, 40)], t_seq=64)


# ---- decode ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_step_nan_stays_in_its_slot(backend):
    check_step_nan(backend)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_step_strided_state_indices(backend, idx_dtype):
    check_step_strided_indices(backend, idx_dtype)


# ---- the look-back's published words -----------------------------------------------------------------

@triton.jit
def _pack_then_look_back_kernel(a, b, ws, out, j, D, N_TILES: tl.constexpr, REVERSE: tl.constexpr,
                                BD: tl.constexpr, W: tl.constexpr):
    # publish every tile's map (A, B) as the kernels do, then the carry entering tile j
    cols = tl.arange(0, BD)
    cmask = cols < D
    n_tiles = N_TILES
    for t in tl.static_range(N_TILES):
        x = tl.load(a + t * D + cols, mask=cmask, other=1.0)
        y = tl.load(b + t * D + cols, mask=cmask, other=0.0)
        tl.store(ws + t * D + cols, K._pack(x, y), mask=cmask)
    s = K._lookback_walk(ws, j, cols, cmask, D, n_tiles, REVERSE, W)
    tl.store(out + cols, s, mask=cmask)


@pytest.mark.parametrize("reverse", [False, True])
def test_lookback_stops_at_resets_only(reverse):
    # A GPU look-back may meet a predecessor's aggregate map before its inclusive state. An aggregate whose
    # decay underflowed to 0 must not read as "inclusive" (the look-back would drop a NaN before it: the
    # state is 0 * NaN = NaN), and a map that resets (a sequence starts in the tile, A < 0) must stop the
    # walk with its own B whatever came before (NaN included). Channels: 0 a NaN before a full decay,
    # 1 a NaN before a reset, 2 a NaN only in the tile farthest away (behind a reset), 3 plain maps.
    n_tiles, d = 6, 4
    a = torch.rand(n_tiles, d, device=DEV) + 0.5
    b = torch.randn(n_tiles, d, device=DEV)
    near = (lambda i: n_tiles - 1 - i) if reverse else (lambda i: i)   # i-th tile from the chain's start
    b[near(1), 0] = float("nan")
    a[near(2), 0] = 0.0                        # full decay: 0 * NaN = NaN
    b[near(1), 1] = float("nan")
    a[near(3), 1] = -1.0                       # a sequence starts in tile 3: B only
    a[near(2), 2], b[near(0), 2] = -1.0, float("nan")
    j = near(5)
    expect = torch.zeros(d, dtype=torch.float64, device=DEV)
    for i in range(5):                          # apply the farthest map first
        t = near(i)
        ai, bi = a[t].double(), b[t].double()
        expect = torch.where(ai < 0, bi, ai * expect + bi)
    out = torch.full((d,), 7.0, device=DEV)
    ws = torch.zeros(n_tiles, d, dtype=torch.int64, device=DEV)
    _pack_then_look_back_kernel[(1,)](a, b, ws, out, j, d, N_TILES=n_tiles, REVERSE=reverse, BD=4, W=2)
    assert torch.isnan(expect[0]) and torch.isfinite(expect[1:]).all()
    assert torch.isnan(out[0]), "a full decay after a NaN read as an inclusive state"
    torch.testing.assert_close(out[1:].double(), expect[1:], rtol=1e-5, atol=1e-5)


# ---- the log-depth scan reference (the GPU tests' ground truth) --------------------------------------

def test_scan_reference_nan_matches_spec():
    from delta_attn.reference import gated_diag_scan
    for c in CASES.values():
        c = dict(c)
        lens, nan_at = c.pop("lens"), c.pop("nan_at")
        q, k, v, g, h0, cu = nan_case(lens, 2, 3, torch.float64, nan_at=nan_at, **c)
        if h0 is not None:
            h0 = h0.double()
        do, dht = torch.randn_like(q), torch.randn(len(lens), 2, 3, device=DEV, dtype=torch.float64)
        o64, ht64, g64 = spec_with_grads(q, k, v, g, h0, cu, do, dht, True)
        o, ht, grads = gated_diag_scan(q, k, v, g, h0, cu, do, dht)
        for x, r in zip((o, ht) + tuple(x for x in grads if x is not None), (o64, ht64) + tuple(g64)):
            torch.testing.assert_close(x, r, equal_nan=True)
