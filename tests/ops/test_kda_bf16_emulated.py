"""bf16 KDA on the CPU interpreter with the GPU's bf16 arithmetic (``gluon_emulator.triton_bf16_on_cpu``).

The training intra-chunk kernel forms Aqk's off-diagonal entries from bf16-rounded factors; its diagonal
(D_ii = 1) must be q_i . k_i formed in fp32 and rounded once, as the inference kernel does: from the rounded
factors a one-token bf16 sequence's dbeta was 1.1x over the error rule on the H100 (test_kda_gpu seed 500)."""
from __future__ import annotations

import pytest
import torch

import properties as P
from gluon_emulator import triton_bf16_on_cpu
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


@pytest.mark.parametrize("K,T", [(16, 1), (32, 5), (64, 64)])
def test_train_aqk_diagonal_is_rounded_once(K, T, monkeypatch):
    q, k = _near_orthogonal_qk(T, K, seed=K + T)
    v = torch.randn(1, T, 1, 16).bfloat16()
    g = torch.zeros(1, T, 1, K)
    beta = torch.rand(1, T, 1).bfloat16()
    scale = K ** -0.5
    with triton_bf16_on_cpu(monkeypatch):
        _, _, saved = launch.train_forward(q, k, v, g.bfloat16(), beta, None, None, None, None, scale, None, True,
                                           False, False)
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
