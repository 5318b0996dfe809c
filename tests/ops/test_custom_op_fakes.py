"""The fake (meta) implementation of every custom op must describe the real outputs exactly: shapes,
dtypes *and strides*. Inductor asserts the strides of what a custom op returns against its fake, so
a fake that copies a non-contiguous input's strides (``torch.empty_like``) breaks a compiled model
whose projections hand the op strided views (found on the H200: the KDA backward under inductor)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import delta_attn  # noqa: F401  (registers the custom ops)
from delta_attn.ops.diag import autograd as diag_ops  # noqa: F401
from delta_attn.ops.flash import autograd as flash_ops  # noqa: F401
from delta_attn.ops.kda import autograd as kda_ops  # noqa: F401


def _strided(*shape, dtype=torch.float32):
    """A tensor of ``shape`` whose storage is laid out heads-first: a permuted, non-contiguous view."""
    b, t, h, d = shape
    return torch.randn(b, h, t, d, dtype=dtype).permute(0, 2, 1, 3)


def _meta(outs):
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    return [(tuple(o.shape), o.dtype, o.stride()) for o in outs if o.numel() > 0]


def _fake_run(op, args):
    with FakeTensorMode() as mode:
        fake = lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a      # noqa: E731
        fargs = [[fake(x) for x in a] if isinstance(a, (list, tuple)) else fake(a) for a in args]
        return _meta(op(*fargs))


def _kda_inputs():
    torch.manual_seed(0)
    q, k, v, g = (_strided(1, 5, 2, 16) for _ in range(4))
    g = -torch.rand(1, 2, 5, 16).permute(0, 2, 1, 3)
    beta = torch.rand(1, 2, 5).permute(0, 2, 1)
    return q, k, v, g, beta


@pytest.mark.parametrize("which", ["kda_infer", "kda_train", "kda_train_bwd", "kda_step", "kda_step_spec"])
def test_kda_fakes_match_real_strides(which):
    q, k, v, g, beta = _kda_inputs()
    assert not q.is_contiguous() and not beta.is_contiguous()
    h0 = torch.randn(1, 2, 16, 16)
    fwd = (q, k, v, g, beta, h0, None, None, None, 0.25, None, True, True, False)
    if which in ("kda_infer", "kda_train"):
        args = fwd
    elif which == "kda_train_bwd":
        saved = torch.ops.delta_attn.kda_train(*fwd)[2:]
        args = (q, k, v, g, beta, h0, None, None, None, saved, _strided(1, 5, 2, 16), torch.randn(1, 2, 16, 16),
                0.25, None, True, False)
    elif which == "kda_step":
        args = (q, k, v, g, beta, h0.clone(), None, None, None, 0.25, None, True)
    else:                                       # speculative: (B, T) slots of a pool, accepted tokens
        pool = torch.randn(6, 2, 16, 16)
        slots = torch.arange(5, dtype=torch.int32).view(1, 5)
        args = (q, k, v, g, beta, pool, slots, None, None, 0.25, None, True, torch.tensor([2], dtype=torch.int32))
    op = getattr(torch.ops.delta_attn, which.replace("_spec", ""))
    real = _meta(op(*args))
    assert real, "the op returned nothing to compare"
    assert _fake_run(op, args) == real


@pytest.mark.parametrize("which", ["diag_fwd", "diag_bwd", "diag_step", "diag_step_spec"])
def test_diag_fakes_match_real_strides(which):
    torch.manual_seed(0)
    q, k, v = (_strided(1, 5, 2, 8) for _ in range(3))
    g = -torch.rand(1, 2, 5, 8).permute(0, 2, 1, 3)
    h0 = torch.randn(1, 2, 8)
    op = getattr(torch.ops.delta_attn, which.replace("_spec", ""))
    if which == "diag_fwd":
        args = (q, k, v, g, h0, None, True)
    elif which == "diag_bwd":
        _, _, ws = torch.ops.delta_attn.diag_fwd(q, k, v, g, h0, None, True)
        args = (q, k, v, g, _strided(1, 5, 2, 8), ws, h0, torch.randn(1, 2, 8), None)
    elif which == "diag_step":
        args = (q, k, v, g, h0.clone(), None)
    else:                                       # speculative: (B, T) slots of a pool, accepted tokens
        slots = torch.arange(5, dtype=torch.int32).view(1, 5)
        args = (q, k, v, g, torch.randn(6, 2, 8), slots, torch.tensor([3], dtype=torch.int32))
    real = _meta(op(*args))
    assert real, "the op returned nothing to compare"
    assert _fake_run(op, args) == real


@pytest.mark.parametrize("which", ["flash_attn_fwd", "flash_attn_bwd", "flash_attn_bwd+dlse"])
def test_flash_fakes_match_real_strides(which):
    torch.manual_seed(0)
    q = _strided(1, 5, 2, 16, dtype=torch.float16)
    k, v = (_strided(1, 7, 1, 16, dtype=torch.float16) for _ in range(2))
    alibi = torch.rand(2)
    fwd = (q, k, v, None, None, 5, 7, "bshd", 0.25, -1, 0, 0.0, alibi, 0.0)
    op = getattr(torch.ops.delta_attn, which.split("+")[0])
    if which == "flash_attn_fwd":
        args = fwd
    else:
        out, lse, seed = torch.ops.delta_attn.flash_attn_fwd(*fwd)
        args = (_strided(1, 5, 2, 16, dtype=torch.float16), q, k, v, out, lse, seed, None, None, 5, 7, "bshd", 0.25,
                -1, 0, 0.0, alibi, 0.0) + ((torch.randn(lse.shape),) if which.endswith("+dlse") else ())
    real = _meta(op(*args))
    assert real, "the op returned nothing to compare"
    assert _fake_run(op, args) == real


def test_kvcache_fake_matches_real_strides():
    torch.manual_seed(0)
    q = _strided(2, 3, 4, 16)
    k_cache, v_cache = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    k, v = _strided(2, 2, 2, 16), _strided(2, 2, 2, 16)
    seqlens = torch.tensor([1, 4], dtype=torch.int32)
    args = (q, k_cache, v_cache, k, v, None, None, seqlens, None, None, None, None, 0.25, -1, 0, 0.0, False, False,
            2)
    real = _meta(torch.ops.delta_attn.flash_kvcache(*args))
    assert real, "the op returned nothing to compare"
    assert _fake_run(torch.ops.delta_attn.flash_kvcache, args) == real


COVERED = {"flash_attn_fwd", "flash_attn_bwd", "kda_infer", "kda_train", "kda_train_bwd", "kda_step", "diag_fwd",
           "diag_bwd", "diag_step", "flash_kvcache"}


def test_every_custom_op_is_covered():
    """Every delta_attn custom op follows the one wrapper pattern (docs/ARCHITECTURE.md) and has its fake
    checked here: a new op must be added to the tests above."""
    names = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("delta_attn::")}
    assert names == COVERED, f"custom ops without a fake test: {sorted(names - COVERED)}"
