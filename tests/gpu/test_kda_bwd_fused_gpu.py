"""The Gluon factored intra-chunk backward of KDA training (``ops/kda/kernels_backward_gluon.py``, with the per-chunk
gradients of the scan's operands folded in) on an sm_90 GPU (marked `gpu`), in its domain (bf16 q, k, v, fp32 g and
beta, K = V = 128, no gate parameters):

(a) kernel against kernels: the training backward runs twice on the same saved tensors, once with the Gluon kernel
    (no ``_kda_bwd_chunk_grads_kernel`` launch) and once with the Triton path, ``_kda_bwd_chunk_grads_kernel`` then
    the ``EXACT=False`` launch (the dispatch forced by patching ``launch._bwd_intra_fused_unsupported``); what each
    factored launch wrote (dq per value head, dk, dv, dbeta, dg, the flags, and DQG, DKD, DW, DAQK, DGC: the Gluon
    kernel's own for the flagged pairs, stage 2's in the Triton run) is read right after it ran. The flags must be
    equal; on the (chunk, value head) pairs left unflagged the outputs must agree within BF16_TOL of the largest
    entry of their value head. The Gluon kernel forms the two dAqk products on bf16 operands (dAqk, fa, fb rounded
    at 2^-9 where the Triton kernel has tf32, 2^-11): a float64 emulation of the kernel with these roundings and du
    rounded to bf16, on CPU against the Triton path with fp32 tensors and exact dots (these cases, l2 on and off),
    differs by at most 6.9e-3 of the largest entry (dq, "pair" with the l2 norm; dk, dg 2.5e-3, dbeta 6e-4, dv 3e-7;
    without these roundings at most 1.4e-6). 2^-5 leaves a factor 4.5 for the tf32 truncations of the GPU while a
    wrong row, column or transposition is off by the entry itself. On the flagged pairs, the tensors the Gluon kernel
    wrote for the EXACT launch are stage 2's products on the same bf16 operands with fp32 accumulation (another order
    of the sums): within STAGE2_TOL of each value head's largest entry; after the Triton EXACT launch, which redoes
    the flagged pairs from them, the two runs' outputs on those pairs agree within REDONE_TOL (the EXACT launch is
    linear in them).
(b) the whole gradients of ``da.kda(..., backend="triton")`` against the float64 reference with the error rule
    (tests/properties.kda_compare), the Gluon kernel checked to have run and stage 2 not.

Decays: long memory (logsigmoid(N(4, 1))), strong (logsigmoid(N(0, 1))), and -1e4 planted at one token (floored to
-30: still factored) or at two tokens of a chunk past its middle (|G - G_mid| > 60: flagged, redone exactly); packed
sequences whose last chunks are short; GVA (HV = 2H); use_qk_l2norm on and off.
"""
from __future__ import annotations

import pytest
import torch

import kda_gluon_cases as C

DEV = "cuda"
K = V = 128
BF16_TOL = 2.0 ** -5
STAGE2_TOL = 2.0 ** -12     # fp32 sums of the same bf16 products in another order
REDONE_TOL = 2.0 ** -10
OUTPUTS = ("DQO", "DKO", "DV", "DB", "DG")
STAGE2 = ("DQG", "DKD", "DW", "DAQK", "DGC")
STAGE2_KERNEL = "_kda_bwd_chunk_grads_kernel"


pytestmark = pytest.mark.skipif(not C.gluon_runs("_bwd_intra_fused_unsupported"),
                                reason="the Gluon KDA backward does not run on this GPU / Triton")


@pytest.fixture
def factored_runs(monkeypatch):
    return spy_factored(monkeypatch)


def spy_factored(monkeypatch):
    """Every run of an intra-chunk backward launch, as (kernel name, EXACT, {tensor: a copy taken right after it
    ran}: the outputs, the flags and the stage-2 tensors), and the name of every launch (``factored_runs.launched``);
    the launches run at the end of ``compiled_together`` through ``_launch._run``."""
    from delta_attn.ops import _launch
    runs = _Runs()
    real = _launch._run

    def spy(p):
        chosen = real(p)
        name = C.kernel_name(p.kernel)
        runs.launched.append(name)
        if name in ("_kda_bwd_intra_fused_kernel", "_kda_bwd_intra_kernel"):
            args = dict(zip(p.kernel.arg_names, p.args))
            runs.append((name, bool(p.fixed.get("EXACT", False)),
                         {n: args[n].clone() for n in OUTPUTS + ("FLAGS",) + STAGE2}))
        return chosen

    monkeypatch.setattr(_launch, "_run", spy)
    return runs


class _Runs(list):
    def __init__(self):
        super().__init__()
        self.launched = []

    def clear(self):
        super().clear()
        self.launched.clear()


def _inputs(B, T, H, HV, decay: str, cu, l2: bool, seed=0):
    """Without the l2 norm, k scaled by K^-1/2 (as tests/properties.kda_inputs): |k| ~ 1 keeps T = (I + A)^-1
    well conditioned."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen).to(DEV, torch.bfloat16)
    k = (torch.randn(B, T, H, K, generator=gen) * (1.0 if l2 else K ** -0.5)).to(DEV, torch.bfloat16)
    v = torch.randn(B, T, HV, V, generator=gen).to(DEV, torch.bfloat16)
    g = C.decays((B, T, HV, K), decay, gen, cu).to(DEV)
    beta = torch.rand(B, T, HV, generator=gen).to(DEV)
    do = torch.randn(B, T, HV, V, generator=gen).to(DEV, torch.bfloat16)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV) if cu is not None else None
    N = B if cu is None else len(cu) - 1
    dht = torch.randn(N, HV, K, V, generator=gen).to(DEV)
    return q, k, v, g, beta, do, dht, cu_t


def _backward_twice(monkeypatch, factored_runs, B, T, H, HV, decay, cu, l2):
    """The factored launch's outputs and the final ones of the Gluon run and the forced Triton run, and the chunk
    table."""
    from delta_attn.ops.kda import launch
    q, k, v, g, beta, do, dht, cu_t = _inputs(B, T, H, HV, decay, cu, l2)
    scale = K ** -0.5
    _, _, saved = launch.train_forward(q, k, v, g, beta, None, cu_t, None, None, scale, None, l2, True, False)
    out = {}
    for mode in ("gluon", "triton"):
        if mode == "triton":
            monkeypatch.setattr(launch, "_bwd_intra_fused_unsupported", lambda *a, **kw: "forced")
        factored_runs.clear()
        launch.train_backward(q, k, v, g, beta, None, cu_t, None, None, saved, do, dht, scale, None, l2, False)
        C.sync(DEV)
        names = [(n, e) for n, e, _ in factored_runs]
        first = "_kda_bwd_intra_fused_kernel" if mode == "gluon" else "_kda_bwd_intra_kernel"
        assert names == [(first, False), ("_kda_bwd_intra_kernel", True)], names
        assert (STAGE2_KERNEL in factored_runs.launched) == (mode == "triton"), factored_runs.launched
        out[mode] = (factored_runs[0][2], factored_runs[1][2])
    ch = launch.chunk_tables(B, T, cu_t, q.device, launch.TRAIN_CHUNK)
    return out, ch.chunk_t.cpu()


CASES = [
    # (B, T, H, HV, decay, cu_seqlens)
    (2, 256, 2, 2, "long", None),
    (2, 256, 2, 2, "strong", None),
    (1, 300, 1, 2, "long", (0, 100, 237, 300)),       # packed: chunks of 64, 36, 64, 64, 9, 63 rows
    (2, 200, 2, 4, "one", None),                      # -1e4 at one token per chunk: floored, factored
    (1, 333, 2, 4, "pair", (0, 150, 333)),            # two -1e4 tokens past the middle: flagged, redone exactly
]


@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("B,T,H,HV,decay,cu", CASES)
def test_gluon_against_triton_factored_launch(B, T, H, HV, decay, cu, l2, monkeypatch, factored_runs):
    out, chunk_t = _backward_twice(monkeypatch, factored_runs, B, T, H, HV, decay, cu, l2)
    (g1, g2), (t1, t2) = out["gluon"], out["triton"]
    flags = g1["FLAGS"]
    assert torch.equal(flags, t1["FLAGS"]), "the Gluon kernel flags other (chunk, value head) pairs"
    if decay == "pair":
        assert int(flags.sum()) > 0, "the planted pair of -1e4 decays must flag its chunks"
    if decay in ("long", "one"):
        assert int(flags.sum()) == 0
    R = B * T
    keep = C.pair_rows(chunk_t, flags, R)
    for n in OUTPUTS:
        a, b = g1[n].reshape(R, HV, -1), t1[n].reshape(R, HV, -1)
        err = C.per_head_error(a, b, keep)
        assert err <= BF16_TOL, f"{n}: {err:.3e} of the largest entry > {BF16_TOL:.3e}"
    # the EXACT launch's inputs on the flagged pairs: the Gluon kernel's against stage 2's
    flagged = ~keep
    if flagged.any():
        for n in STAGE2[:-1]:
            a, b = g1[n].reshape(R, HV, -1), t1[n].reshape(R, HV, -1)
            err = C.per_head_error(a, b, flagged)
            assert err <= STAGE2_TOL, f"{n} on the flagged pairs: {err:.3e} of the largest entry > {STAGE2_TOL:.3e}"
        nc = flags.shape[0]
        a, b = g1["DGC"][:nc], t1["DGC"][:nc]
        err = C.per_head_error(a, b, flags.cpu().bool())
        assert err <= STAGE2_TOL, f"DGC on the flagged pairs: {err:.3e} > {STAGE2_TOL:.3e}"
    # after the EXACT launch: the flagged pairs were redone from those inputs
    for n in OUTPUTS:
        a, b = g2[n].reshape(R, HV, -1), t2[n].reshape(R, HV, -1)
        err = C.per_head_error(a, b, flagged)
        assert err <= REDONE_TOL, f"{n}: the redone pairs differ by {err:.3e} of the largest entry"
        assert C.per_head_error(a, b, keep) <= BF16_TOL


def test_nan_groups_flagged_as_triton(monkeypatch, factored_runs):
    """A K slice NaN from row 5 of each chunk on (a 16-channel group NaN throughout, as the range test sees it): the
    Gluon kernel flags the pairs the Triton kernel flags (the outputs there are NaN by design: not compared)."""
    out, _ = _backward_twice(monkeypatch, factored_runs, 1, 200, 1, 2, "nan", (0, 120, 200), False)
    flags = out["gluon"][0]["FLAGS"]
    assert int(flags.sum()) > 0, "the NaN groups must flag their chunks"
    assert torch.equal(flags, out["triton"][0]["FLAGS"])


@pytest.mark.parametrize("B,T,cu,H,HV,l2,decay,fp32_gb", C.WHOLE)
def test_whole_gradients_against_float64(B, T, cu, H, HV, l2, decay, fp32_gb, factored_runs):
    C.whole_gradients_pass(DEV, B, T, cu, H, HV, l2, decay, fp32_gb)
    ran = [(n, e) for n, e, _ in factored_runs]
    assert ("_kda_bwd_intra_fused_kernel", False) in ran, ran
    assert STAGE2_KERNEL not in factored_runs.launched, "stage 2 runs in the Gluon domain"
    if decay == "pair":
        assert any(int(o["FLAGS"].sum()) > 0 for n, _, o in factored_runs if n == "_kda_bwd_intra_fused_kernel")


@pytest.mark.parametrize("l2", [True, False])
def test_bf16_g_and_beta_read_as_given(l2, monkeypatch):
    """bf16 g and beta reach the Gluon training kernels (intra-chunk forward and backward) as given, widened on chip:
    o and every gradient equal, bit for bit, those of the same call with g and beta widened to float32 first (dg and
    dbeta rounded to bf16 as the bf16 call returns them); a chunk past FACTOR_MAX (redone by Triton) included."""
    import delta_attn as da
    from delta_attn.ops import _launch
    seen, real = [], _launch._run

    def spy(p):
        if C.kernel_name(p.kernel) in ("_kda_train_intra_fused_kernel", "_kda_bwd_intra_fused_kernel"):
            args = dict(zip(p.kernel.arg_names, p.args))
            seen.append((C.kernel_name(p.kernel), args["g"].dtype, args["beta"].dtype))
        return real(p)

    monkeypatch.setattr(_launch, "_run", spy)
    q, k, v, g, beta, do, _, cu_t = _inputs(1, 300, 2, 2, "pair", (0, 100, 300), l2)
    g16, b16 = g.bfloat16(), beta.bfloat16()

    def run(gg, bb):
        xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, gg, bb)]
        o, _ = da.kda(*xs, cu_seqlens=cu_t, use_qk_l2norm=l2, backend="triton")
        o.backward(do)
        return [o] + [x.grad for x in xs]

    got, ref = run(g16, b16), run(g16.float(), b16.float())
    assert seen == [("_kda_train_intra_fused_kernel", torch.bfloat16, torch.bfloat16),
                    ("_kda_bwd_intra_fused_kernel", torch.bfloat16, torch.bfloat16),
                    ("_kda_train_intra_fused_kernel", torch.float32, torch.float32),
                    ("_kda_bwd_intra_fused_kernel", torch.float32, torch.float32)], seen
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, ref):
        assert torch.equal(a, b.to(a.dtype)), name
