"""The domain of a raw log decay: g <= 0 (issue 29).

Without ``A_log``, g of ``kda``, ``kda_step``, ``gated_diag_attn``, ``gated_diag_step`` and of their
context-parallel forms is a log decay: a positive entry (a state that grows) is a ValueError naming g, checked
wherever value checks run (``_checks.value_checks_enabled``: not while torch.compile traces, not under CUDA-graph
capture, not with DELTA_ATTN_SKIP_VALUE_CHECKS=1). NaN keeps its documented meaning (tests/ops/test_diag_nan.py) and
is not refused; with ``A_log`` g is the raw gate input and may have any sign.
"""
import pytest
import torch
import torch.distributed as dist

import delta_attn as da
import delta_attn.distributed as dd
from delta_attn import _checks

B, T, H, D = 1, 5, 2, 16


def _inputs(g):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    return q, k, v, g, torch.rand(B, T, H, generator=gen)


def _kda(g, **kw):
    return da.kda(*_inputs(g), backend="torch", **kw)


def _kda_step(g, **kw):
    q, k, v, g, beta = _inputs(g)
    return da.kda_step(q, k, v, g, beta, torch.zeros(B, H, D, D), backend="torch", **kw)


def _diag(g):
    return da.gated_diag_attn(*_inputs(g)[:4], backend="torch")


def _diag_step(g):
    return da.gated_diag_step(*_inputs(g)[:4], torch.zeros(B, H, D), backend="torch")


@pytest.fixture(scope="module")
def gloo():
    """One gloo rank: the context-parallel forms with world size 1."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def _dd_kda(g, **kw):
    return dd.kda(*_inputs(g), backend="torch", **kw)


def _dd_diag(g):
    return dd.gated_diag_attn(*_inputs(g)[:4], backend="torch")


OPS = {"kda": _kda, "kda_step": _kda_step, "gated_diag_attn": _diag, "gated_diag_step": _diag_step,
       "dd.kda": _dd_kda, "dd.gated_diag_attn": _dd_diag}


@pytest.fixture(params=list(OPS))
def op(request):
    if request.param.startswith("dd."):
        request.getfixturevalue("gloo")
    return OPS[request.param]


def _g(value=None, where=(0, 3, 1, 7)):
    g = -torch.rand(B, T, H, D)
    if value is not None:
        g[where] = value
    return g


@pytest.mark.parametrize("value", [1e-3, 2.0, float("inf")])
def test_a_positive_log_decay_is_refused_naming_g(op, value):
    with pytest.raises(ValueError, match=r"^g is a log decay and must be <= 0") as e:
        op(_g(value))
    assert f"got a value of {value:g}" in str(e.value)


@pytest.mark.parametrize("value", [0.0, -1e4, float("-inf"), float("nan")])
def test_zero_full_decay_reset_and_nan_are_in_the_domain(op, value):
    op(_g(value))


def test_nan_does_not_hide_a_positive_entry(op):
    g = _g(float("nan"))
    g[0, 1, 0, 2] = 0.5
    with pytest.raises(ValueError, match="got a value of 0.5"):
        op(g)


@pytest.mark.parametrize("call", [_kda, _kda_step, _dd_kda])
def test_with_a_log_g_is_the_raw_gate_and_may_be_positive(call, request):
    if call is _dd_kda:
        request.getfixturevalue("gloo")
    call(torch.randn(B, T, H, D).abs() + 0.1, A_log=torch.zeros(H))


def test_kda_names_the_gate_for_a_raw_gate_input():
    with pytest.raises(ValueError, match="pass A_log"):
        _kda(_g(1.0))


def test_skipped_where_value_checks_are(op, monkeypatch):
    """The switch of the cu_seqlens value checks: DELTA_ATTN_SKIP_VALUE_CHECKS=1, torch.compile tracing,
    CUDA-graph capture (no host read there); the caller then keeps g <= 0."""
    monkeypatch.setenv("DELTA_ATTN_SKIP_VALUE_CHECKS", "1")
    op(_g(1.0))
    monkeypatch.delenv("DELTA_ATTN_SKIP_VALUE_CHECKS")
    for switch in ("_tracing", "_capturing"):
        with monkeypatch.context() as m:
            m.setattr(_checks, switch, lambda: True)
            op(_g(1.0))
    with pytest.raises(ValueError, match="^g is a log decay"):
        op(_g(1.0))


def test_one_reduction_and_one_host_read(monkeypatch):
    """The check costs one reduction over g and one device-to-host read (a second pass only when g holds NaN)."""
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self.numel()) or item(self))
    _checks.log_decay("g", _g())
    assert reads == [1]


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("nan", [False, True])
def test_triton_kda_reduces_g_before_its_kernels(grad, nan, monkeypatch):
    """On the Triton backend (fp32 here: the Triton kernels, not the Gluon ones) the pending check's reduction of g
    is enqueued before the call's first kernel and read after its last is enqueued: a positive g raises from the
    call (a NaN elsewhere does not hide it); a valid g then runs."""
    import kda_gluon_cases as C
    events = C.spy_check_order(monkeypatch)
    g = -torch.rand(2, 40, H, D)
    g[1, 33, 1, 7] = 0.25
    if nan:
        g[0, 3, 0, 2] = float("nan")
    q, k, v = (torch.randn(2, 40, H, D) for _ in range(3))
    beta = torch.rand(2, 40, H)
    q.requires_grad_(grad)
    with pytest.raises(ValueError, match="^g is a log decay and must be <= 0.*0.25"):
        da.kda(q, k, v, g, beta, backend="triton")
    assert C.reduced_before_kernels(events, g), events
    o, _ = da.kda(q, k, v, g.clamp(max=0.0), beta, backend="triton")
    assert torch.isfinite(o[1]).all()


@pytest.mark.parametrize("grad", [False, True])
def test_training_calls_take_the_small_reduction(grad, monkeypatch):
    """``da.kda`` hands the check the small reduction of ``ops/_decay_max.py`` (``_prepare.positive_max_on_gpu``)
    when the call trains (its kernels leave room on every SM) and torch's amax otherwise (the fused inference
    forward takes every register); gated_diag_attn always takes amax."""
    from delta_attn.ops._prepare import positive_max_on_gpu
    seen, real_run = [], _checks.PendingChecks.run
    monkeypatch.setattr(_checks.PendingChecks, "run",
                        lambda self, route, args, device_max=None, **kw: seen.append(device_max)
                        or real_run(self, route, args, device_max, **kw))
    q, k, v = (torch.randn(2, 40, H, D) for _ in range(3))
    q.requires_grad_(grad)
    da.kda(q, k, v, -torch.rand(2, 40, H, D), torch.rand(2, 40, H), backend="triton")
    da.gated_diag_attn(q, k, v, -torch.rand(2, 40, H, D), backend="triton")
    assert seen == [positive_max_on_gpu if grad else None, None]


@pytest.mark.parametrize("fits", [False, True])
def test_inference_calls_take_the_small_reduction_where_it_fits(fits, monkeypatch):
    """A CUDA inference call takes the small reduction where its kernels leave it room
    (``launch.check_fits_beside``: the fused forward's warp-specialised form), torch's amax elsewhere."""
    import types
    from delta_attn.ops._prepare import positive_max_on_gpu
    from delta_attn.ops.kda import api, launch
    monkeypatch.setattr(launch, "check_fits_beside", lambda q, v, A_log, num_seqs: fits)
    args = types.SimpleNamespace(q=types.SimpleNamespace(is_cuda=True), v=None, A_log=None, num_seqs=8,
                                 needs_grad=lambda: False)
    assert api._check_reduction(args) is (positive_max_on_gpu if fits else None)


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("top", [0.0, 0.5])
def test_kernels_that_report_the_maximum_replace_the_reduction(top, view, monkeypatch):
    """With ``kernels_report`` nothing reduces g: the implementation's kernel hands the check a reader of g's
    maximum through ``decay_report_sink`` (reached with g or a tensor sharing its storage, as a launcher behind a
    ``torch.library`` op sees it; not with another tensor, nor outside the call), and the verdict is that reader's
    value."""
    reduced = []
    amax = torch.Tensor.amax
    monkeypatch.setattr(torch.Tensor, "amax", lambda self, *a, **kw: reduced.append(self.numel()) or amax(self, *a,
                                                                                                          **kw))
    g = torch.full((4, 3), -0.5)
    pending = _checks.PendingChecks()
    _checks.log_decay("g", g, pending=pending)

    def impl(args):
        assert _checks.decay_report_sink(g.clone()) is None
        _checks.decay_report_sink(g.view(4, 3) if view else g)(lambda: top)
        assert _checks.decay_report_sink(g) is None            # reported once
        return "out"

    if top > 0:
        with pytest.raises(ValueError, match="^g is a log decay.*0.5"):
            pending.run(lambda: impl, None, kernels_report=True)
    else:
        assert pending.run(lambda: impl, None, kernels_report=True) == "out"
    assert reduced == [] and _checks.decay_report_sink(g) is None


def test_a_check_its_kernels_leave_unreported_is_reduced_after_them(monkeypatch):
    """With ``kernels_report`` but an implementation that reports nothing (another backend ran), g is reduced after
    the implementation's work, and a positive g still raises."""
    events = []
    amax = torch.Tensor.amax
    monkeypatch.setattr(torch.Tensor, "amax", lambda self, *a, **kw: events.append("reduce") or amax(self, *a, **kw))
    pending = _checks.PendingChecks()
    _checks.log_decay("g", torch.tensor([-1.0, 0.25]), pending=pending)
    with pytest.raises(ValueError, match="^g is a log decay.*0.25"):
        pending.run(lambda: lambda args: events.append("impl"), None, kernels_report=True)
    assert events == ["impl", "reduce"]


@pytest.mark.parametrize("grad,backend,cuda,gluon,expect", [
    (True, "auto", True, True, True), (True, "triton", True, True, True), (True, "triton", False, True, True),
    (True, "auto", False, True, False), (True, "cudnn", True, True, False), (True, "torch", True, True, False),
    (False, "auto", True, True, False), (True, "auto", True, False, False)])
def test_training_on_the_gluon_kernels_lets_them_report(grad, backend, cuda, gluon, expect, monkeypatch):
    """``kda``'s api expects the kernels to report g's maximum for a training call on the Triton backend (named, or
    ``auto`` on CUDA) whose first kernel is the Gluon intra-chunk forward reading g as given
    (``launch.train_reports_decay``)."""
    import types
    from delta_attn.ops.kda import api, launch
    monkeypatch.setattr(launch, "train_reports_decay", lambda *a: gluon)
    args = types.SimpleNamespace(q=types.SimpleNamespace(is_cuda=cuda), v=None, g=None, A_log=None, dt_bias=None,
                                 lower_bound=None, allow_tf32=False, needs_grad=lambda: grad)
    assert api._kernels_report(args, backend) is expect


def test_a_call_failing_after_the_reduction_raises_its_own_error(monkeypatch):
    """A call whose implementation fails after the check's reduction was started raises that failure (not the
    check's verdict, even for a positive g), having waited for the reduction (``PendingChecks.settle``)."""
    settled, real_settle = [], _checks.PendingChecks.settle
    monkeypatch.setattr(_checks.PendingChecks, "settle",
                        lambda self: settled.append([callable(d.top) for d in self.decays]) or real_settle(self))
    pending = _checks.PendingChecks()
    _checks.log_decay("g", torch.full((3,), 0.5), pending=pending)

    def fail(args):
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        pending.run(lambda: fail, None)
    assert settled == [[True]]
    with pytest.raises(ValueError, match="^g is a log decay.*0.5"):     # the verdict was read by nobody
        pending.finish()


def test_the_reduction_of_g_records_no_autograd_node(monkeypatch):
    """The check reduces a detached g: with g requiring grad, no autograd node (and no AccumulateGrad for g) is made
    on the check's side stream, where g's gradient would then be accumulated."""
    import kda_gluon_cases as C
    events = C.spy_check_order(monkeypatch)
    g = (-torch.rand(B, T, H, D)).requires_grad_(True)
    o, _ = _kda(g)
    o.sum().backward()
    assert [e for e in events if e[:2] == ("reduce", g.numel())] == [("reduce", g.numel(), None, False)], events
    assert g.grad is not None and torch.isfinite(g.grad).all()
