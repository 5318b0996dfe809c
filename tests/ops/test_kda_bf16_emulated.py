"""bf16 KDA on the CPU interpreter with the GPU's bf16 arithmetic (``gluon_emulator.triton_bf16_on_cpu``).

The training intra-chunk kernel forms Aqk's off-diagonal entries from bf16-rounded factors; its diagonal
(D_ii = 1) must be q_i . k_i formed in fp32 and rounded once, as the inference kernel does: from the rounded
factors a one-token bf16 sequence's dbeta was 1.1x over the error rule on the H100 (test_kda_gpu seed 500), and the
Gluon training kernel of the bf16 K = V = 128 domain was 124 / 1,536 ulps off at 1 / 64 tokens on these inputs."""
from __future__ import annotations

import pytest
import torch

import properties as P
from gluon_emulator import on_cpu, triton_bf16_on_cpu
from delta_attn.ops.kda import launch


def _near_orthogonal_qk(T: int, K: int, seed: int):
    """q and k whose rows are nearly orthogonal: q . k is small against sum |q_i k_i| (the bf16 rounding of the
    factors then dominates it)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, 1, K, generator=gen)
    r = torch.randn(1, T, 1, K, generator=gen)
    qn = q / q.norm(dim=-1, keepdim=True)
    k = r - 0.97 * (r * qn).sum(-1, keepdim=True) * qn      # most of r's component along q removed
    return q.bfloat16(), k.bfloat16()


@pytest.mark.parametrize("K,T,gluon", [(16, 1, False), (32, 5, False), (64, 64, False), (128, 1, True),
                                       (128, 64, True)])
def test_train_aqk_diagonal_is_rounded_once(K, T, gluon, monkeypatch):
    """The training forward's stored Aqk diagonal is scale q_i . k_i (L2-normed) within one bf16 ulp, on the Triton
    kernel (gluon False) and on the Gluon kernel of its domain (the emulator, ``gluon_emulator.on_cpu``)."""
    q, k = _near_orthogonal_qk(T, K, seed=K + T)
    V = 128 if gluon else 16
    v = torch.randn(1, T, 1, V).bfloat16()
    g = torch.zeros(1, T, 1, K).bfloat16()
    beta = torch.rand(1, T, 1).bfloat16()
    scale = K ** -0.5
    with on_cpu(monkeypatch) if gluon else triton_bf16_on_cpu(monkeypatch):
        prec = launch.precision(q.dtype, False, K, train=True)
        assert (launch._train_intra_fused_unsupported(q, v, None, None, None, prec, launch.compile_device(q.device))
                is None) == gluon
        _, _, saved = launch.train_forward(q, k, v, g, beta, None, None, None, None, scale, None, True, False, False)
    diag = saved.AQK.float().reshape(-1, launch.TRAIN_CHUNK)[:T].diagonal()
    qd, kd = q.double()[0, :, 0], k.double()[0, :, 0]
    exact = scale * (qd / qd.norm(dim=-1, keepdim=True) * kd / kd.norm(dim=-1, keepdim=True)).sum(-1)
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs()         # one bf16 ulp (at most) of each entry
    err = (diag.double() - exact).abs()
    assert (err <= ulp + 1e-6).all(), f"Aqk diagonal off by {(err / ulp).max():.1f} ulp"


@pytest.mark.parametrize("seed", [500, 241])
def test_gpu_seeds_pass_on_the_emulated_arithmetic(seed, monkeypatch):
    """test_kda_gpu seeds found on the GPU (500: one token, the Aqk diagonal; 241: the UT transform's U)."""
    case = P.draw_kda(10_000 + seed, "gpu")
    with triton_bf16_on_cpu(monkeypatch):
        bad = P.kda_check(case, "cpu")
    assert not bad, f"{case}: " + "; ".join(bad)

