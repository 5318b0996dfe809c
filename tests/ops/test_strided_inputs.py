"""Strided views of every index and parameter argument of every Triton op reach the kernels unit-stride.

Every launcher prepares what its kernels receive through the launch layer (``ops/_launch.py``:
``index``, ``param``, ``unit_last``, ``optional``). Each test passes every index / parameter / state
argument of one op as a stride-2 view whose skipped elements hold *other valid values* (a kernel that
read the view's memory as unit-stride would compute something else, not crash), and requires outputs,
final states, updated state pools and gradients bit-identical to the same call on contiguous copies.
Ops are driven through the public API (``backend="triton"``) and through the launchers directly (the
kernel boundary). Triton interpreter on CPU, tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

import delta_attn as da
from delta_attn import settings
from delta_attn.ops import _launch

pytestmark = pytest.mark.skipif(not settings.triton_interpreter() and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter or a GPU")
DEV = "cuda" if torch.cuda.is_available() and not settings.triton_interpreter() else "cpu"


def strided(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``x``'s values as a view with every stride doubled; the interleaved elements are ``other``'s."""
    view = torch.stack([x, other.to(x.dtype)], -1)[..., 0]
    assert torch.equal(view, x) and not view.is_contiguous() and view.stride(-1) == 2
    return view


def cu_view(cu: torch.Tensor) -> torch.Tensor:
    # read unit-stride, [0, 0, c1, c1, ...] is another valid (shorter) cu_seqlens
    return strided(cu, cu)


def _identical(a, b, what):
    a = [t for t in a if t is not None]
    b = [t for t in b if t is not None]
    assert len(a) == len(b) and a, what
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape and x.dtype == y.dtype, (what, i)
        assert torch.equal(x, y), f"{what}: output {i} differs with strided inputs"


def _run(fn, leaves, extra):
    """fn(leaves, extra) -> outputs (first one differentiable when leaves are); returns outputs + grads."""
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in leaves]
    outs = [o for o in fn(xs, extra) if o is not None]
    grads = ()
    if outs[0].requires_grad:
        diff = [x for x in xs if x.requires_grad]
        grads = torch.autograd.grad(outs[0].float().sum() + sum(o.float().sum() for o in outs[1:]
                                                                if o.requires_grad), diff, allow_unused=True)
    return [o.detach() for o in outs] + [g for g in grads if g is not None]


def _check(fn, leaves, contiguous: dict, views: dict, what: str):
    _identical(_run(fn, leaves, views), _run(fn, leaves, contiguous), what)


# ------------------------------------------------------------------------------------------- flash

def _flash_inputs(lq, lk, hq=2, hk=1, d=16):
    q = torch.randn(sum(lq), hq, d, device=DEV).half()
    k, v = torch.randn(2, sum(lk), hk, d, device=DEV).half().unbind(0)
    return q, k, v


def test_flash_varlen_cu_seqlens_and_alibi():
    lq, lk = [5, 0, 9], [3, 6, 9]
    cu_q = torch.tensor([0, 5, 5, 14], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 3, 9, 18], dtype=torch.int32, device=DEV)
    alibi = torch.rand(3, 2, device=DEV)                          # (N, Hq)
    views = dict(cu_q=cu_view(cu_q), cu_k=cu_view(cu_k), alibi=strided(alibi, alibi + 1))
    plain = dict(cu_q=cu_q, cu_k=cu_k, alibi=alibi)

    def fn(xs, a):
        out, lse, _ = da.flash_attn_varlen_func(*xs, a["cu_q"], a["cu_k"], max(lq), max(lk), causal=True,
                                                alibi_slopes=a["alibi"], return_attn_probs=True, backend="triton")
        return out, lse
    _check(fn, _flash_inputs(lq, lk), plain, views, "flash_attn_varlen_func")


def test_flash_dense_alibi_and_operands():
    q, k, v = torch.randn(3, 1, 7, 2, 16, device=DEV).half().unbind(0)
    alibi = torch.rand(2, device=DEV)

    def fn(xs, a):
        if a["strided"]:
            xs = [strided(x, x + 1) for x in xs]
        out, lse, _ = da.flash_attn_func(*xs, alibi_slopes=a["alibi"], return_attn_probs=True, backend="triton")
        return out, lse
    _check(fn, (q, k, v), dict(alibi=alibi, strided=False), dict(alibi=strided(alibi, alibi + 1), strided=True),
           "flash_attn_func")


def test_flash_launchers_take_strided_cu_seqlens():
    from delta_attn.ops.flash import launch as ti
    lq = [5, 0, 9]
    q, k, v = _flash_inputs(lq, lq)
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32, device=DEV)
    a = ti.flash_fwd(q, k, v, cu, cu, 9, 9, "thd", 0.25, -1, 0)
    b = ti.flash_fwd(q, k, v, cu_view(cu), cu_view(cu), 9, 9, "thd", 0.25, -1, 0)
    _identical(a, b, "flash_fwd")
    do = torch.randn_like(a[0])
    ga = ti.flash_bwd(do, q, k, v, *a, cu, cu, 9, 9, "thd", 0.25, -1, 0)
    gb = ti.flash_bwd(do, q, k, v, *a, cu_view(cu), cu_view(cu), 9, 9, "thd", 0.25, -1, 0)
    _identical(ga, gb, "flash_bwd")


# --------------------------------------------------------------------------------------------- kda

def _kda_inputs(b, t, h=1, hv=2, k=16, v=16):
    q, kk = torch.randn(2, b, t, h, k, device=DEV).unbind(0)
    vv = torch.randn(b, t, hv, v, device=DEV)
    g = torch.randn(b, t, hv, k, device=DEV)          # raw gate: A_log / dt_bias make the decay
    beta = torch.rand(b, t, hv, device=DEV)
    return q, kk, vv, g, beta


def _kda_params(n, hv=2, k=16, v=16):
    A_log, dt_bias = torch.rand(hv, device=DEV) - 1, torch.randn(hv * k, device=DEV) * 0.1
    h0 = torch.randn(n, hv, k, v, device=DEV)
    plain = dict(A_log=A_log, dt_bias=dt_bias, h0=h0)
    views = dict(A_log=strided(A_log, A_log + 5), dt_bias=strided(dt_bias, dt_bias + 3), h0=strided(h0, h0 + 10))
    return plain, views


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
def test_kda_cu_seqlens_gate_parameters_and_state(grad):
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32, device=DEV)
    plain, views = _kda_params(3)
    plain["cu"], views["cu"] = cu, cu_view(cu)

    def fn(xs, a):
        if a is views:
            xs = [strided(x, x + 1) for x in xs]            # q, k, v, g, beta strided too
        with torch.set_grad_enabled(grad):
            return da.kda(*xs, initial_state=a["h0"], output_final_state=True, cu_seqlens=a["cu"],
                          A_log=a["A_log"], dt_bias=a["dt_bias"], use_qk_l2norm=True, backend="triton")
    _check(fn, _kda_inputs(1, 20), plain, views, "kda")


def test_kda_step_state_indices_and_gate_parameters():
    plain, views = _kda_params(4)
    idx = torch.tensor([2, 0, 3], device=DEV)
    plain["idx"], views["idx"] = idx, strided(idx, torch.tensor([3, 2, 0], device=DEV))
    pool = torch.randn(4, 2, 16, 16, device=DEV)
    q, k, v, g, beta = _kda_inputs(3, 2)

    def fn(xs, a):
        if a is views:
            xs = [strided(x, x + 1) for x in xs]
        state = pool.clone()
        o = da.kda_step(*xs, state, state_indices=a["idx"], A_log=a["A_log"], dt_bias=a["dt_bias"],
                        lower_bound=-5.0, backend="triton")
        return o, state
    _identical(fn((q, k, v, g, beta), views), fn((q, k, v, g, beta), plain), "kda_step")


def _spec_slots():
    """(B, T) = (2, 2) speculative slots and accepted counts, plain and as stride-2 views over other valid ones."""
    idx = torch.tensor([[4, 1], [2, 5]], device=DEV)
    nat = torch.tensor([2, 1], device=DEV)
    return (dict(idx=idx, nat=nat),
            dict(idx=strided(idx, torch.tensor([[1, 4], [5, 2]], device=DEV)),
                 nat=strided(nat, torch.tensor([1, 2], device=DEV))))


def test_kda_step_speculative_slots_and_accepted_tokens():
    plain, views = _spec_slots()
    pool = torch.randn(6, 2, 16, 16, device=DEV)
    q, k, v, g, beta = _kda_inputs(2, 2)
    g = -g.abs()                                       # a log decay (no gate parameters here)

    def fn(xs, a):
        state = pool.clone()
        o = da.kda_step(*xs, state, state_indices=a["idx"], num_accepted_tokens=a["nat"], backend="triton")
        return o, state
    _identical(fn((q, k, v, g, beta), views), fn((q, k, v, g, beta), plain), "kda_step speculative")


# -------------------------------------------------------------------------------------------- diag

def _diag_inputs(b, t, h=2, d=16):
    q, k, v = torch.randn(3, b, t, h, d, device=DEV).unbind(0)
    return q, k, v, -torch.rand(b, t, h, d, device=DEV)


@pytest.mark.parametrize("grad", [False, True], ids=["infer", "train"])
def test_gated_diag_cu_seqlens_and_state(grad):
    cu = torch.tensor([0, 9, 9, 21], dtype=torch.int32, device=DEV)
    h0 = torch.randn(3, 2, 16, device=DEV)
    plain = dict(cu=cu, h0=h0)
    views = dict(cu=cu_view(cu), h0=strided(h0, h0 + 10))

    def fn(xs, a):
        if a is views:
            xs = [strided(x, x + 1) for x in xs]
        with torch.set_grad_enabled(grad):
            return da.gated_diag_attn(*xs, initial_state=a["h0"], output_final_state=True, cu_seqlens=a["cu"],
                                      backend="triton")
    _check(fn, _diag_inputs(1, 21), plain, views, "gated_diag_attn")


def test_gated_diag_step_state_indices():
    idx = torch.tensor([1, 3, 0], device=DEV)
    plain, views = dict(idx=idx), dict(idx=strided(idx, torch.tensor([0, 1, 3], device=DEV)))
    pool = torch.randn(4, 2, 16, device=DEV)

    def fn(xs, a):
        if a is views:
            xs = [strided(x, x + 1) for x in xs]
        state = pool.clone()
        return da.gated_diag_step(*xs, state, state_indices=a["idx"], backend="triton"), state
    leaves = [x.detach() for x in _diag_inputs(3, 2)]
    _identical(fn(leaves, views), fn(leaves, plain), "gated_diag_step")


def test_gated_diag_step_speculative_slots_and_accepted_tokens():
    plain, views = _spec_slots()
    pool = torch.randn(6, 2, 16, device=DEV)

    def fn(xs, a):
        state = pool.clone()
        return da.gated_diag_step(*xs, state, state_indices=a["idx"], num_accepted_tokens=a["nat"],
                                  backend="triton"), state
    leaves = [x.detach() for x in _diag_inputs(2, 2)]
    _identical(fn(leaves, views), fn(leaves, plain), "gated_diag_step speculative")


def test_diag_launchers_take_strided_cu_seqlens_and_states():
    from delta_attn.ops.diag import launch as ti
    q, k, v, g = _diag_inputs(1, 21)
    cu = torch.tensor([0, 9, 9, 21], dtype=torch.int32, device=DEV)
    h0 = torch.randn(3, 2, 16, device=DEV)
    a = ti.diag_fwd(q, k, v, g, h0, cu, True, training=True)
    b = ti.diag_fwd(q, k, v, g, strided(h0, h0 + 10), cu_view(cu), True, training=True)
    _identical(a, b, "diag_fwd")
    do, dht = torch.randn_like(q), torch.randn_like(h0)
    ga = ti.diag_bwd(q, k, v, g, do, a[2], h0, dht, cu)
    gb = ti.diag_bwd(q, k, v, g, strided(do, do + 1), a[2], strided(h0, h0 + 10), strided(dht, dht + 1), cu_view(cu))
    _identical(ga, gb, "diag_bwd")


# ---------------------------------------------------------------------------------------- the layer

def test_prepare_helpers():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert _launch.index(cu) is cu                                     # already right: no copy
    got = _launch.index(cu_view(cu.long()))
    assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got, cu)
    assert _launch.index(None) is None and _launch.param(None) is None
    x = torch.randn(4, 3).t()
    assert _launch.param(x).is_contiguous() and torch.equal(_launch.param(x), x)
    assert _launch.param(x, torch.float64).dtype == torch.float64
    d1, d2 = _launch.optional(None, x), _launch.optional(None, torch.randn(2))
    assert d1 is d2 and d1.numel() == 1 and d1.dtype == x.dtype        # one placeholder per device and dtype
    assert _launch.optional(x, cu) is x
    assert _launch.unit_last(x).stride(-1) == 1 and _launch.unit_last(x.t()) is not None
    assert _launch.sm_count(torch.device("cpu")) == 4
