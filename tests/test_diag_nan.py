"""Non-finite gates in gated diagonal attention: a NaN stays in its own sequence (issue 15).

The semantics (``da.gated_diag_attn``'s docstring, docs/ARCHITECTURE.md): the recurrence is evaluated as
written, sequence by sequence. A NaN in g at token p of sequence n makes that sequence's state NaN from p
on: its outputs from p on and its final state (``exp(NaN) s``; a full decay after it does not wash it
out, ``0 * NaN = NaN``; a NaN at a first token with no initial state gives ``exp(NaN) * 0 = NaN``).
Every other sequence of the batch is computed exactly as without it: a sequence start selects the
state, it never multiplies the previous sequence's by 0. Gradients are NaN exactly where autograd
through the float64 specification gives NaN, which is inside the NaN sequence only.

CPU: the Triton interpreter (the interpreter's configs and the GPU's) and backend="torch".
tests/gpu/test_diag_gpu.py runs the same checks with thousands of tiles in flight (it imports the
helpers of this module).
"""
import itertools

import pytest
import torch
import triton
import triton.language as tl

import delta_attn as da
from delta_attn import reference
from delta_attn.ops.diag import kernels_scan as K
from delta_attn.testing import assert_close, poison_outputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["triton", "torch"]

pytestmark = pytest.mark.skipif(not da.backends.triton_interpreter_on() and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter or a GPU")


# ---- shared helpers (also used by tests/gpu/test_diag_gpu.py) ---------------------------------------

def nan_case(lens, h, d, dtype, g_dtype=None, *, nan_at=(), full_decay=0, h0=True, lo=-1.0, device=DEV):
    """A packed batch (B == 1) of sequences ``lens`` with g NaN on the whole row of token p of sequence n
    for each (n, p) in ``nan_at``, followed by ``full_decay`` rows of g = -1e4 in the same sequence.
    Returns (q, k, v, g, initial state or None, cu_seqlens)."""
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=device)
    total = int(cu[-1])
    q, k, v = (torch.randn(1, total, h, d, device=device).to(dtype) for _ in range(3))
    g = torch.rand(1, total, h, d, device=device) * lo
    for n, p in nan_at:
        row = int(cu[n]) + p
        g[:, row + 1:min(row + 1 + full_decay, int(cu[n + 1]))] = -1e4
        g[:, row] = float("nan")
    s0 = torch.randn(len(lens), h, d, device=device) if h0 else None
    return q, k, v, g.to(g_dtype or dtype), s0, cu


def spec_with_grads(q, k, v, g, h0, cu, do, dht, upcast):
    """o, final state and (dq, dk, dv, dg[, d h0]) by autograd through the loop specification, in float64
    (upcast) or in the inputs' dtype."""
    cast = (lambda x: x.double()) if upcast else (lambda x: x)
    leaves = [cast(x).detach().requires_grad_() for x in (q, k, v, g)]
    s0 = cast(h0).detach().requires_grad_() if h0 is not None else None
    o, ht = reference.gated_diag(*leaves, initial_state=s0, output_final_state=True, cu_seqlens=cu, upcast=upcast)
    torch.autograd.backward((o, ht), (cast(do).to(o.dtype), cast(dht).to(ht.dtype)))
    return o, ht, [x.grad for x in leaves] + ([s0.grad] if s0 is not None else [])


def public_with_grads(backend):
    """run(q, k, v, g, h0, cu, do, dht) -> (o, final state, grads) through ``da.gated_diag_attn``, outputs poisoned."""
    def run(q, k, v, g, h0, cu, do, dht):
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]
        s0 = h0.detach().requires_grad_() if h0 is not None else None
        with poison_outputs():
            o, ht = da.gated_diag_attn(*leaves, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                                       backend=backend)
            torch.autograd.backward((o, ht), (do, dht))
        return o, ht, [x.grad for x in leaves] + ([s0.grad] if s0 is not None else [])
    return run


def launchers_with_grads(fwd_config, bwd_config, training=False):
    """run(...) through the launchers with explicit kernel configs (e.g. the GPU's under the interpreter)."""
    from delta_attn.ops.diag import launch as ti

    def run(q, k, v, g, h0, cu, do, dht):
        with poison_outputs():
            o, ht, ws = ti.diag_fwd(q, k, v, g, h0, cu, True, config=fwd_config, training=training)
            grads = ti.diag_bwd(q, k, v, g, do, ws, h0, dht, cu, config=bwd_config,
                                fwd_bt=fwd_config.segment_rows if training else fwd_config.bt)
        return o, ht, list(grads[:4]) + ([grads[4]] if h0 is not None else [])
    return run


def assert_nan_where_reference(out, ref64, ref_lp, *, kind="fwd", name="output"):
    """NaN exactly where the float64 reference is NaN (the low-precision baseline agrees), every other
    entry within the error rule."""
    bad = torch.isnan(ref64).cpu()
    assert torch.equal(torch.isnan(ref_lp).cpu(), bad), f"{name}: the baselines disagree on NaN"
    got = torch.isnan(out).cpu()
    extra, missing = int((got & ~bad).sum()), int((bad & ~got).sum())
    assert extra == 0 and missing == 0, (f"{name}: NaN at {extra} entries where the reference is finite, "
                                         f"finite at {missing} where it is NaN")
    keep = ~bad.to(out.device)
    assert_close(out[keep], ref64[keep], ref_lp[keep], kind=kind, name=name)


def assert_sequences_isolated(o, ht, grads, cu, nan_at, t_seq=None):
    """The semantics, stated directly: a sequence holding a NaN gate has NaN outputs from that token on
    (finite before) and a NaN final state; every other sequence's outputs, final state and gradients are
    finite. ``cu`` None: the batch's rows are the sequences (``t_seq`` tokens each)."""
    h, d = o.shape[-2:]
    total = o.shape[0] * o.shape[1]
    bounds = (cu.tolist() if cu is not None else list(range(0, total + 1, t_seq)))
    of = o.reshape(total, h, d)
    poisoned = {n: p for n, p in nan_at}
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if n in poisoned:
            p = a + poisoned[n]
            assert torch.isfinite(of[a:p]).all(), f"sequence {n}: outputs before the NaN gate must be finite"
            assert torch.isnan(of[p:b]).all(), f"sequence {n}: outputs from the NaN gate on must be NaN"
            assert torch.isnan(ht[n]).all(), f"sequence {n}: the final state must be NaN"
            continue
        assert torch.isfinite(of[a:b]).all(), f"sequence {n}: a NaN of another sequence leaked into its outputs"
        assert torch.isfinite(ht[n]).all(), f"sequence {n}: a NaN leaked into its final state"
        for i, x in enumerate(grads):
            rows = x[n] if i == 4 else x.reshape(total, h, d)[a:b]
            assert torch.isfinite(rows).all(), f"sequence {n}: a NaN leaked into gradient {i}"


def check_nan_run(run, ref, q, k, v, g, h0, cu, nan_at, t_seq=None):
    """``run`` against ``ref`` (both ``(q, k, v, g, h0, cu, do, dht[, upcast]) -> (o, ht, grads)``)."""
    n = cu.shape[0] - 1 if cu is not None else q.shape[0]
    do = torch.randn_like(q)
    dht = torch.randn(n, q.shape[2], q.shape[3], device=q.device)
    o, ht, grads = run(q, k, v, g, h0, cu, do, dht)
    o64, ht64, g64 = ref(q, k, v, g, h0, cu, do, dht, True)
    olp, htlp, glp = ref(q, k, v, g, h0, cu, do, dht, False)
    assert o.dtype == q.dtype and ht.dtype == torch.float32
    assert_sequences_isolated(o, ht, grads, cu, nan_at, t_seq)
    assert_nan_where_reference(o, o64, olp, name="o")
    assert_nan_where_reference(ht, ht64, htlp, name="final_state")
    for name, x, r64, rlp in zip(["dq", "dk", "dv", "dg", "d_initial_state"], grads, g64, glp):
        assert_nan_where_reference(x, r64, rlp.to(x.dtype), kind="grad", name=name)


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

def check_step_nan(backend, device=DEV, b=4, t=3, h=2, d=20):
    """gated_diag_step with a NaN gate in sequence 1 (token 1): its slot ends NaN, every other slot equals the
    reference, slots of no sequence are untouched."""
    q, k, v = (torch.randn(b, t, h, d, device=device) for _ in range(3))
    g = -torch.rand(b, t, h, d, device=device)
    g[1, 1] = float("nan")
    pool = torch.randn(7, h, d, device=device)
    idx = torch.tensor([5, 0, 3, 6], dtype=torch.int32, device=device)[:b]
    h0 = pool[idx.long()].clone()
    others = [i for i in range(7) if i not in idx.tolist()]
    untouched = pool[others].clone()
    with poison_outputs():
        o = da.gated_diag_step(q, k, v, g, pool, state_indices=idx, backend=backend)
    o64, ht64 = reference.gated_diag(q, k, v, g, initial_state=h0, output_final_state=True)
    olp, _ = reference.gated_diag(q, k, v, g, initial_state=h0, output_final_state=True, upcast=False)
    assert_sequences_isolated(o, pool[idx.long()], [], None, [(1, 1)], t_seq=t)
    assert_nan_where_reference(o, o64, olp, name="o")
    assert_nan_where_reference(pool[idx.long()], ht64.float(), ht64.float(), name="state")
    assert torch.equal(pool[others], untouched)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_nan_stays_in_its_slot(backend):
    check_step_nan(backend)


def check_step_strided_indices(backend, idx_dtype, device=DEV, b=3, t=2, h=2, d=20):
    """state_indices as a strided view (stride 3): each sequence reads and writes its own slot only."""
    q, k, v = (torch.randn(b, t, h, d, device=device) for _ in range(3))
    g = -torch.rand(b, t, h, d, device=device)
    wide = torch.tensor([[4, 0, 1], [1, 2, 0], [6, 3, 5]], dtype=idx_dtype, device=device)
    idx = wide.t()[0]                                    # [4, 1, 6], stride 3
    assert idx.stride() == (3,) and not idx.is_contiguous()
    pool = torch.randn(8, h, d, device=device)
    h0 = pool[idx.long()].clone()
    rest = [i for i in range(8) if i not in (4, 1, 6)]
    untouched = pool[rest].clone()
    with poison_outputs():
        o = da.gated_diag_step(q, k, v, g, pool, state_indices=idx, backend=backend)
    o64, ht64 = reference.gated_diag(q, k, v, g, initial_state=h0, output_final_state=True)
    olp, _ = reference.gated_diag(q, k, v, g, initial_state=h0, output_final_state=True, upcast=False)
    assert_close(o, o64, olp, name="o")
    torch.testing.assert_close(pool[[4, 1, 6]], ht64.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[rest], untouched), "a slot of no sequence was written"


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
