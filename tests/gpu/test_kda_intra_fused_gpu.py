"""The Gluon intra-chunk forward of KDA training (``ops/kda/kernels_intra_gluon.py``) on an sm_90 GPU (marked `gpu`),
in its domain (bf16 q, k, v, fp32 g and beta, K = V = 128, no gate parameters):

(a) kernel against kernel: the training forward runs twice on the same inputs, once with the Gluon kernel followed by
    the Triton ``ONLY_FLAGGED`` launch, once with the Triton kernel alone (the dispatch forced by patching
    ``launch._train_intra_fused_unsupported``); what each launch wrote (W, U, QG, KD, AQK, GC, TM, the flags) is read
    right after it ran.
    * flags: the Gluon kernel's must be the Triton kernel's range test evaluated on the host (per 32-channel K slice,
      ``max |G - G_mid| <= FACTOR_MAX`` with the GPU's NaN-ignoring maximum);
    * unflagged pairs: the Gluon kernel rounds every bf16 / tf32 operand where the Triton kernel rounds it, so the two
      differ only by the order of their fp32 sums and the roundings that order moves. A float64 emulation of both on
      CPU (the Gluon one checked against the Triton kernel in the interpreter to 1e-6, fp32, exact dots), with every
      fp32 sum of one of them moved by up to 2 ulps, differs by at most 5.5e-3 of a value head's largest entry for
      the bf16 outputs (one bf16 ulp, 2^-8 to 2^-7 of an entry, moved near the largest one) and 2.2e-4 for TM. The
      tolerances, 2^-5 (bf16 outputs) and 2^-9 (TM, GC), leave a factor 5 to 9 while a wrong row, column or
      transposition is off by the entry itself;
    * after the ONLY_FLAGGED launch: the flagged pairs are bit for bit the Triton kernel's (the same code on the same
      inputs), the others are what the Gluon kernel wrote.
(b) the whole gradients of ``da.kda(..., backend="triton")`` against the float64 reference with the error rule
    (tests/properties.kda_compare), the Gluon kernel checked to have run (and the Gluon backward with it).

Decays: long memory (logsigmoid(N(4, 1))), strong (logsigmoid(N(0, 1))), -1e4 planted at one token (floored to -30:
still factored) or at two tokens of a chunk past its middle (|G - G_mid| > 60: flagged, redone by Triton), a NaN gate
over a whole K slice before a chunk's middle (flagged); packed sequences whose last chunks are short; GVA (HV = 2H and
4H); use_qk_l2norm on and off.
"""
from __future__ import annotations

import pytest
import torch

import kda_gluon_cases as C

DEV = "cuda"
K = V = 128
BF16_TOL = 2.0 ** -5
FP32_TOL = 2.0 ** -9
PLANTED = slice(32, 48)     # the channels of the planted -1e4 decays (the second K slice of 32)
OUTPUTS = ("W", "U", "QG", "KD", "AQK", "GC", "TM")
TOL = dict(W=BF16_TOL, U=BF16_TOL, QG=BF16_TOL, KD=BF16_TOL, AQK=BF16_TOL, GC=FP32_TOL, TM=FP32_TOL)


pytestmark = pytest.mark.skipif(not C.gluon_runs("_train_intra_fused_unsupported"),
                                reason="the Gluon KDA intra-chunk forward does not run here")


@pytest.fixture
def intra_runs(monkeypatch):
    return spy_intra(monkeypatch)


def spy_intra(monkeypatch):
    """Every run of an intra-chunk forward launch, as (kernel name, ONLY_FLAGGED, {output: a copy taken right after it
    ran}, chunk table); the launches run at the end of ``compiled_together`` through ``_launch._run``."""
    from delta_attn.ops import _launch
    runs = []
    real = _launch._run

    def spy(p):
        chosen = real(p)
        name = C.kernel_name(p.kernel)
        if name in ("_kda_train_intra_fused_kernel", "_kda_train_intra_kernel"):
            args = dict(zip(p.kernel.arg_names, p.args))
            outs = {n: args[n].clone() for n in OUTPUTS + ("FLAGS",) + (("GMAX",) if p.fixed.get("GTOP") else ())}
            runs.append((name, bool(p.fixed.get("ONLY_FLAGGED", False)), outs, args["chunk_info"].cpu()))
        return chosen

    monkeypatch.setattr(_launch, "_run", spy)
    return runs


def _inputs(B, T, H, HV, decay: str, cu, l2: bool, seed=0):
    """Without the l2 norm, k scaled by K^-1/2 (as tests/properties.kda_inputs)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen).to(DEV, torch.bfloat16)
    k = (torch.randn(B, T, H, K, generator=gen) * (1.0 if l2 else K ** -0.5)).to(DEV, torch.bfloat16)
    v = torch.randn(B, T, HV, V, generator=gen).to(DEV, torch.bfloat16)
    g = C.decays((B, T, HV, K), decay, gen, cu, planted=PLANTED).to(DEV)
    beta = torch.rand(B, T, HV, generator=gen).to(DEV)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV) if cu is not None else None
    return q, k, v, g, beta, cu_t


def _expected_flags(g: torch.Tensor, chunk_t: torch.Tensor, HV: int) -> torch.Tensor:
    """The Triton kernel's range test per (chunk, value head), on the host in float64: a pair is flagged when one of
    its 32-channel K slices has max |G - G[31]| > FACTOR_MAX or is NaN throughout (the GPU's maximum ignores NaN)."""
    from delta_attn.ops.kda import launch
    gf = g.double().cpu().reshape(-1, HV, K)
    out = torch.zeros(chunk_t.shape[0], HV, dtype=torch.int32)
    for c, (_, row0, L) in enumerate(chunk_t.tolist()):
        d = gf[row0:row0 + L]
        d = torch.where(d < -launch.DECAY_FLOOR, -launch.DECAY_FLOOR, d)
        G = torch.cumsum(torch.cat([d, torch.zeros(64 - L, HV, K, dtype=d.dtype)]), 0)
        Gm = (G - G[31]).abs()
        for hv in range(HV):
            for s in range(K // 32):
                x = Gm[:, hv, 32 * s:32 * s + 32]
                fin = x[~torch.isnan(x)]
                if fin.numel() == 0 or float(fin.max()) > launch.FACTOR_MAX:
                    out[c, hv] = 1
    return out


def _rows(x: torch.Tensor, HV: int, name: str, chunk_t: torch.Tensor, R: int) -> torch.Tensor:
    """(R, HV, n) of a row-wise output; GC (per chunk) spread over each chunk's rows."""
    if name != "GC":
        return x.reshape(R, HV, -1).cpu()
    out = torch.zeros(R, HV, K, dtype=x.dtype)
    for c, (_, row0, L) in enumerate(chunk_t.tolist()):
        out[row0:row0 + L] = x[c].cpu()[None]
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal entry for entry, NaN equal to NaN."""
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _forward_twice(monkeypatch, intra_runs, B, T, H, HV, decay, cu, l2):
    from delta_attn.ops.kda import launch
    q, k, v, g, beta, cu_t = _inputs(B, T, H, HV, decay, cu, l2)
    out = {}
    for mode in ("gluon", "triton"):
        if mode == "triton":
            monkeypatch.setattr(launch, "_train_intra_fused_unsupported", lambda *a, **kw: "forced")
        intra_runs.clear()
        launch.train_forward(q, k, v, g, beta, None, cu_t, None, None, K ** -0.5, None, l2, True, False)
        C.sync(DEV)
        names = [(n, f) for n, f, _, _ in intra_runs]
        want = ([("_kda_train_intra_fused_kernel", False), ("_kda_train_intra_kernel", True)] if mode == "gluon"
                else [("_kda_train_intra_kernel", False)])
        assert names == want, names
        out[mode] = [o for _, _, o, _ in intra_runs]
    return out, intra_runs[0][3], g


CASES = [
    # (B, T, H, HV, decay, cu_seqlens)
    (2, 256, 2, 2, "long", None),
    (2, 256, 2, 2, "strong", None),
    (1, 300, 1, 2, "long", (0, 100, 237, 300)),       # packed: chunks of 64, 36, 64, 64, 9, 63 rows
    (2, 200, 2, 4, "one", None),                      # -1e4 at one token per chunk: floored, factored
    (1, 333, 2, 4, "pair", (0, 150, 333)),            # two -1e4 tokens past the middle: flagged, redone by Triton
    (1, 200, 1, 2, "nan", (0, 120, 200)),             # a NaN K slice before the middle: flagged
]


@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("B,T,H,HV,decay,cu", CASES)
def test_gluon_against_triton(B, T, H, HV, decay, cu, l2, monkeypatch, intra_runs):
    out, chunk_t, g = _forward_twice(monkeypatch, intra_runs, B, T, H, HV, decay, cu, l2)
    (g1, g2), (t1,) = out["gluon"], out["triton"]
    flags = g1["FLAGS"].cpu()
    assert torch.equal(flags, _expected_flags(g, chunk_t, HV)), "the Gluon kernel flags other pairs"
    if decay in ("pair", "nan"):
        assert int(flags.sum()) > 0, "the planted decays must flag their chunks"
    if decay in ("long", "strong", "one"):
        assert int(flags.sum()) == 0
    R = B * T
    keep = C.pair_rows(chunk_t, flags, R)
    for n in OUTPUTS:
        a, b = _rows(g1[n], HV, n, chunk_t, R), _rows(t1[n], HV, n, chunk_t, R)
        err = C.per_head_error(a, b, keep)
        assert err <= TOL[n], f"{n}: {err:.3e} of the largest entry > {TOL[n]:.3e}"
    # after the ONLY_FLAGGED launch: the flagged pairs as the Triton kernel wrote them, the others untouched
    for n in OUTPUTS:
        a, b, c = (_rows(x[n], HV, n, chunk_t, R) for x in (g2, t1, g1))
        assert _same(a[~keep], b[~keep]), f"{n}: the redone pairs differ from the Triton kernel's"
        assert _same(a[keep], c[keep]), f"{n}: the ONLY_FLAGGED launch wrote an unflagged pair"


@pytest.mark.parametrize("B,T,cu,H,HV,l2,decay,fp32_gb", C.WHOLE)
def test_whole_gradients_against_float64(B, T, cu, H, HV, l2, decay, fp32_gb, intra_runs):
    C.whole_gradients_pass(DEV, B, T, cu, H, HV, l2, decay, fp32_gb, planted=PLANTED)
    ran = [(n, f) for n, f, _, _ in intra_runs]
    assert ("_kda_train_intra_fused_kernel", False) in ran, ran
    if decay == "pair":
        assert any(int(o["FLAGS"].sum()) > 0 for n, _, o, _ in intra_runs if n == "_kda_train_intra_fused_kernel")


@pytest.mark.parametrize("nan", [False, True])
def test_positive_decay_reported_by_the_kernel(nan, monkeypatch, intra_runs):
    """Training (gradients on): a positive g still raises from ``da.kda`` (a NaN K slice elsewhere, flagged and
    redone by Triton, does not hide it). The Gluon kernel wrote g's maximum for the check, max(0, g) with NaN read
    as 0 per (chunk, value head), exactly; nothing else reduced g."""
    import delta_attn as da
    events = C.spy_check_order(monkeypatch)
    q, k, v, g, beta, cu_t = _inputs(1, 200, 1, 2, "nan" if nan else "long", (0, 120, 200), True)
    g[0, 100, 1, 40] = 0.25
    g[0, 150, 0, 3] = 0.125
    q.requires_grad_(True)
    with pytest.raises(ValueError, match=r"^g is a log decay and must be <= 0.*0\.25"):
        da.kda(q, k, v, g, beta, cu_seqlens=cu_t, use_qk_l2norm=True, backend="triton")
    fused = [(o, chunk_t) for n, f, o, chunk_t in intra_runs if n == "_kda_train_intra_fused_kernel"]
    assert len(fused) == 1 and "GMAX" in fused[0][0], intra_runs
    (out, chunk_t), = fused
    gf = g.cpu().reshape(-1, 2, K).nan_to_num(nan=0.0).clamp(min=0.0)
    want = torch.stack([gf[row0:row0 + L].amax((0, 2)) for _, row0, L in chunk_t.tolist()])
    assert torch.equal(out["GMAX"].cpu(), want), (out["GMAX"], want)
    assert not [e for e in events if e[:2] == ("reduce", g.numel())], events
