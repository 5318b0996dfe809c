"""The checks of gated diagonal attention with non-finite gates (a NaN stays in its own sequence): seeded NaN
batches, the public call and the launchers with their gradients, and the assertions of the semantics (the
docstring of tests/ops/test_diag_nan.py). Shared by that module and tests/gpu/test_diag_gpu.py, which runs the
same checks with thousands of tiles in flight.
"""
import itertools

import torch

import delta_attn as da
from delta_attn import reference
from delta_attn.testing import assert_close, poison_outputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


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
