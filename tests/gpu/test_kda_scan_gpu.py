"""The Gluon state scans of KDA training (``ops/kda/kernels_scan_gluon.py``) on an sm_90 GPU (marked `gpu`).

The training forward runs twice on the same inputs, and the backward twice on the same saved tensors, once with the
Gluon scan and once with the Triton one (``launch._scan_fused_unsupported`` patched). What each scan wrote (forward:
o, the final state, every chunk-start state, u per token; backward: du per token, every chunk-end state gradient,
the gradient of the initial state) must agree within SCAN_TOL of each tensor's largest entry: both take the same
bf16 operands with fp32 accumulation, in another order, and round the state (gradient) to bf16 at each chunk (2^-9)
before it enters a product. Both operand-ring depths run; dense and packed sequences with short last chunks, a
32-chunk sequence, GVA, strong decays, an initial state and a final-state gradient. The whole gradients against
float64 are checked by tests/gpu/test_kda_bwd_fused_gpu.py, whose calls take these scans too."""
from __future__ import annotations

import pytest
import torch

import kda_gluon_cases as C

DEV = "cuda"
K = V = 128
SCAN_TOL = 2.0 ** -6
SCANS = ("_kda_bwd_scan_fused_kernel", "_kda_bwd_scan_kernel")


def _gluon_runs() -> bool:
    from delta_attn.ops.kda import launch
    if not torch.cuda.is_available():
        return False
    x = torch.empty(1, 1, 1, K, device=DEV, dtype=torch.bfloat16)
    return launch._scan_fused_unsupported(x, x, x.device) is None


pytestmark = pytest.mark.skipif(not _gluon_runs(), reason="the Gluon KDA reverse scan does not run on this GPU")


@pytest.fixture
def scan_runs(monkeypatch):
    return spy_scans(monkeypatch)


def spy_scans(monkeypatch):
    """Every run of a reverse-scan launch: (kernel name, {DU, DH, DH0: copies taken right after it ran})."""
    from delta_attn.ops import _launch
    runs = []
    real = _launch._run

    def spy(p):
        chosen = real(p)
        name = getattr(p.kernel, "fn", p.kernel).__name__
        if name in SCANS:
            args = dict(zip(p.kernel.arg_names, p.args))
            runs.append((name, {n: args[n].clone() for n in ("DU", "DH", "DH0")}))
        return chosen

    monkeypatch.setattr(_launch, "_run", spy)
    return runs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


CASES = [
    # (B, T, H, HV, cu_seqlens, decay mean)
    (2, 256, 2, 2, None, 4.0),
    (1, 300, 1, 2, (0, 100, 237, 300), 4.0),     # chunks of 64, 36, 64, 64, 9, 63 rows
    (1, 2048, 2, 4, None, 4.0),                  # 32 chunks: the state gradient carried far
    (2, 200, 2, 2, None, 0.0),                   # strong decays
]


def _inputs(B, T, H, HV, cu, mean):
    gen = torch.Generator().manual_seed(B * T + HV)
    q = torch.randn(B, T, H, K, generator=gen).to(DEV, torch.bfloat16)
    k = torch.randn(B, T, H, K, generator=gen).to(DEV, torch.bfloat16)
    v = torch.randn(B, T, HV, V, generator=gen).to(DEV, torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, generator=gen) + mean).to(DEV)
    beta = torch.rand(B, T, HV, generator=gen).to(DEV)
    do = torch.randn(B, T, HV, V, generator=gen).to(DEV, torch.bfloat16)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV) if cu is not None else None
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, HV, K, V, generator=gen).to(DEV)
    dht = torch.randn(N, HV, K, V, generator=gen).to(DEV)
    return q, k, v, g, beta, do, cu_t, h0, dht


TILINGS = [("V blocks", 2), ("whole V", 2), ("whole V", 1)]


@pytest.fixture(params=TILINGS, ids=lambda p: f"{p[0]}-{p[1]}stage")
def stages(request, monkeypatch):
    return force_tiles(monkeypatch, *request.param)


def force_tiles(monkeypatch, tiling: str, stages: int) -> int:
    """The scans' tiling (V blocks of 64 or the whole V, as ``scan_fused_tiles`` picks for few or many chains) and
    the operand ring's depth, forced whatever the case's chains."""
    from delta_attn.ops.kda import launch
    real_tiles = launch.scan_fused_tiles
    chains = 1 if tiling == "V blocks" else 1 << 20
    monkeypatch.setattr(launch, "scan_fused_tiles",
                        lambda n, device: tuple(t.with_(STAGES=stages) for t in real_tiles(chains, device)))
    return stages


@pytest.mark.parametrize("B,T,H,HV,cu,mean", CASES)
def test_gluon_forward_scan_against_triton(B, T, H, HV, cu, mean, stages, monkeypatch):
    from delta_attn.ops.kda import launch
    q, k, v, g, beta, do, cu_t, h0, dht = _inputs(B, T, H, HV, cu, mean)
    scale = K ** -0.5
    out = {}
    for mode in ("gluon", "triton"):
        if mode == "triton":
            monkeypatch.setattr(launch, "_scan_fused_unsupported", lambda *a, **kw: "forced")
        o, final, saved = launch.train_forward(q, k, v, g, beta, h0, cu_t, None, None, scale, None, True, True, False)
        C.sync(DEV)
        out[mode] = {"o": o, "final": final, "HS": saved.HS, "VNEW": saved.VNEW}
    NC = launch.chunk_tables(B, T, cu_t, q.device, launch.TRAIN_CHUNK).chunk_t.shape[0]
    for n in ("o", "final", "HS", "VNEW"):
        a, b = out["gluon"][n], out["triton"][n]
        if n == "HS":                          # rows past the chunks are not written
            a, b = a[:NC], b[:NC]
        err = _rel(a, b)
        assert err <= SCAN_TOL, f"{n}: {err:.3e} of the largest entry > {SCAN_TOL:.3e}"


@pytest.mark.parametrize("B,T,H,HV,cu,mean", CASES)
def test_gluon_reverse_scan_against_triton(B, T, H, HV, cu, mean, stages, monkeypatch, scan_runs):
    from delta_attn.ops.kda import launch
    q, k, v, g, beta, do, cu_t, h0, dht = _inputs(B, T, H, HV, cu, mean)
    scale = K ** -0.5
    _, _, saved = launch.train_forward(q, k, v, g, beta, h0, cu_t, None, None, scale, None, True, True, False)
    out = {}
    for mode in ("gluon", "triton"):
        if mode == "triton":
            monkeypatch.setattr(launch, "_scan_fused_unsupported", lambda *a, **kw: "forced")
        scan_runs.clear()
        launch.train_backward(q, k, v, g, beta, h0, cu_t, None, None, saved, do, dht, scale, None, True, False)
        C.sync(DEV)
        assert [n for n, _ in scan_runs] == [SCANS[0] if mode == "gluon" else SCANS[1]]
        out[mode] = scan_runs[0][1]
    NC = launch.chunk_tables(B, T, cu_t, q.device, launch.TRAIN_CHUNK).chunk_t.shape[0]
    for n in ("DU", "DH", "DH0"):
        a, b = out["gluon"][n], out["triton"][n]
        if n == "DH":                          # rows past the chunks (packed batches) are not written
            a, b = a[:NC], b[:NC]
        err = _rel(a, b)
        assert err <= SCAN_TOL, f"{n}: {err:.3e} of the largest entry > {SCAN_TOL:.3e}"
