"""The g <= 0 check's reduction on the GPU (``ops/_decay_max.py``, marked `gpu`): its verdict against torch's on
tensors of every float dtype with planted positive values and NaNs, the tensors it leaves to torch's ``amax``, and
that the public calls reduce g with it."""
from __future__ import annotations

import pytest
import torch

from delta_attn.ops import _decay_max

DEV = "cuda"


def _read(x):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    read = _decay_max.start_positive_max(x, side)
    assert read is not None, "the reduction did not run"
    return read()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [16, 512 * 132 + 16, 3_000_016, 67_108_864])
@pytest.mark.parametrize("plant", [None, "first", "last", "middle", "nan", "nan and positive"])
def test_positive_max_against_torch(dtype, n, plant):
    gen = torch.Generator(device=DEV).manual_seed(n)
    x = -torch.rand(n, device=DEV, generator=gen).to(dtype)
    at = {"first": 0, "last": n - 1, "middle": n // 2, "nan and positive": n // 3}.get(plant)
    if plant in ("nan", "nan and positive"):
        x[n // 5] = float("nan")
    if at is not None:
        x[at] = 0.375
    want = max(0.0, x.float().nan_to_num(0.0).max().item())
    assert _read(x) == want


def test_what_it_leaves_to_torch():
    x = torch.zeros(64, 32, device=DEV)
    assert _decay_max.runs(x)
    assert not _decay_max.runs(x[:, :16])                         # not contiguous
    assert not _decay_max.runs(torch.zeros(24, device=DEV))       # not a multiple of 16 values
    assert not _decay_max.runs(torch.zeros(64, device=DEV, dtype=torch.float64))
    assert not _decay_max.runs(torch.zeros(64))                   # CPU
    assert _decay_max.start_positive_max(x[:, :16], torch.cuda.Stream()) is None


@pytest.mark.parametrize("grad", [False, True])
def test_training_calls_reduce_g_with_it(grad, monkeypatch):
    """A training ``da.kda`` call reduces g with it (and still raises on a positive entry); an inference call and
    gated_diag_attn take torch's amax."""
    import delta_attn as da
    import delta_attn.ops.kda.api as kda_api
    calls = []

    def spy(x, stream):
        calls.append(x.shape)
        return real(x, stream)

    real = kda_api.positive_max_on_gpu
    monkeypatch.setattr(kda_api, "positive_max_on_gpu", spy)
    B, T, H, D = 2, 64, 2, 64
    q, k, v = (torch.randn(B, T, H, D, device=DEV) for _ in range(3))
    q.requires_grad_(grad)
    g = -torch.rand(B, T, H, D, device=DEV)
    da.kda(q, k, v, g, torch.rand(B, T, H, device=DEV), backend="triton")
    da.gated_diag_attn(q, k, v, g, backend="triton")
    g[0, 3, 1, 5] = 0.5
    with pytest.raises(ValueError, match="0.5"):
        da.kda(q, k, v, g, torch.rand(B, T, H, device=DEV), backend="triton")
    assert calls == ([g.shape, g.shape] if grad else [])
