"""Speculative decoding and CUDA-graph rules of the decode steps (``kda_step``, ``gated_diag_step``) on CPU:
the reference backend in float64 and the Triton kernels under the interpreter (fp32, fp16).

Design under test (docstrings, docs/SERVING.md): ``state_indices`` (B, T) gives one slot per new token; the
state after token t of sequence b goes to ``state_indices[b, t]`` and the step starts from
``state_indices[b, num_accepted_tokens[b] - 1]`` (column 0 when None). Two verification rounds are checked
against the float64 reference run token by token over each sequence's accepted prefix followed by the new
tokens (the error rule of docs/TESTING.md, outputs poisoned), every written slot against the state after its token, and
the slots outside the tables untouched. Under a (patched) CUDA-graph capture the host-reading value checks
must not run and no tensor is read on the host.
"""
import pytest
import torch

import delta_attn as da
from delta_attn import _checks, reference
from delta_attn.testing import check, poison_outputs

DT = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16}
# (backend, dtype): the reference path in float64, the Triton kernels (interpreter) in fp32 and fp16
PATHS = [("torch", "fp64"), ("triton", "fp32"), ("triton", "fp16")]


# ---------------------------------------------------------------------------------------------- inputs

def _kda_tokens(gen, B, T, H, HV, K, V, dtype):
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)     # noqa: E731
    g = torch.nn.functional.logsigmoid(rnd(B, T, HV, K) + 2.0)
    g = torch.where(torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) < 0.1, torch.full_like(g, -1e4), g)
    xs = [rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V), g, torch.rand(B, T, HV, generator=gen,
                                                                               dtype=torch.float64)]
    return [x.to(dtype) for x in xs]


def _diag_tokens(gen, B, T, H, D, dtype):
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)     # noqa: E731
    g = -torch.rand(B, T, H, D, generator=gen, dtype=torch.float64) * 2.0
    return [x.to(dtype) for x in (rnd(B, T, H, D), rnd(B, T, H, D), rnd(B, T, H, D), g)]


class Op:
    """One decode operator: its step, its whole-sequence reference and its shapes."""

    def __init__(self, name, B=3, T=4, seed=0):
        self.name, self.B, self.T = name, B, T
        self.gen = torch.Generator().manual_seed(seed)
        if name == "kda":
            self.H, self.HV, self.K, self.V = 1, 2, 16, 16
            self.opts = dict(use_qk_l2norm=True)
            self.state_shape = (self.HV, self.K, self.V)
        else:
            self.H, self.D = 2, 24
            self.opts = {}
            self.state_shape = (self.H, self.D)

    def tokens(self, dtype):
        if self.name == "kda":
            return _kda_tokens(self.gen, self.B, self.T, self.H, self.HV, self.K, self.V, dtype)
        return _diag_tokens(self.gen, self.B, self.T, self.H, self.D, dtype)

    def step(self, xs, pool, backend, **kw):
        if self.name == "kda":
            return da.kda_step(*xs, pool, backend=backend, **self.opts, **kw)
        return da.gated_diag_step(*xs, pool, backend=backend, **kw)

    def ref(self, xs, s0, upcast):
        """(o, final state) of the reference over whole sequences (token by token), from s0."""
        if self.name == "kda":
            return reference.kda(*xs, initial_state=s0, output_final_state=True, upcast=upcast, **self.opts)
        return reference.gated_diag(*xs, initial_state=s0, output_final_state=True, upcast=upcast)


def _expected(op, history, new, s0, b, upcast):
    """Sequence b from s0 over ``history`` (its accepted tokens so far) then ``new``: the outputs of the new
    tokens and the state after each of them (float64 reference, or the same in the input dtype)."""
    row = lambda xs, n: [x[b:b + 1, :n] for x in xs]           # noqa: E731
    cat = lambda a, c: [torch.cat([x, y], 1) for x, y in zip(a, c)]   # noqa: E731
    h = history[0].shape[1]
    o, _ = op.ref(cat(row(history, h), row(new, op.T)), s0[b:b + 1], upcast)
    states = [op.ref(cat(row(history, h), row(new, t + 1)), s0[b:b + 1], upcast)[1][0] for t in range(op.T)]
    return o[0, h:], torch.stack(states)


def _check_round(op, o, pool, table, history, new, s0, dtype):
    """The round's outputs and every slot of its table against the reference (error rule)."""
    for b in range(op.B):
        hist64 = [x.double() for x in history]
        o64, s64 = _expected(op, hist64, [x.double() for x in new], s0.double(), b, True)
        olow, slow = _expected(op, history, new, s0.to(torch.float32 if dtype != torch.float64 else dtype), b,
                               False)
        v = check(o[b], o64, olow, name=f"o of sequence {b}")
        assert v.ok, v.message
        v = check(pool[table[b].long()], s64, slow, name=f"states of sequence {b}")
        assert v.ok, v.message


@pytest.mark.parametrize("which", ["kda", "diag"])
@pytest.mark.parametrize("backend,dt,layout",
                         [(*p, lay) for p, lay in zip(PATHS, ["contiguous", "strided", "contiguous"])])
def test_two_verification_rounds_match_the_accepted_prefixes(which, backend, dt, layout):
    dtype = DT[dt]
    op = Op(which, seed=sum(map(ord, which + dt + layout)))
    B, T = op.B, op.T
    P = 2 * B * T + 3
    pool_dtype = reference.accumulation_dtype(dtype)
    pool = torch.full((P, *op.state_shape), 7.0, dtype=pool_dtype)
    perm = torch.randperm(P, generator=op.gen)
    table1 = perm[:B * T].view(B, T).to(torch.int32)
    # an engine keeps one row of slots per sequence: round 2 reads its start from and rewrites the same table
    table2 = table1
    if layout == "strided":                                        # (B, T) with strides (1, B)
        table2 = table1.t().contiguous().t()
        assert not table2.is_contiguous() and torch.equal(table2, table1)
    untouched = sorted(set(range(P)) - set(table1.flatten().tolist()))
    s0 = (torch.randn(B, *op.state_shape, generator=op.gen, dtype=torch.float64) * 0.5).to(pool_dtype)
    pool[table1[:, 0].long()] = s0

    # round 1: no num_accepted_tokens, every sequence starts from its table's column 0
    x1 = op.tokens(dtype)
    with poison_outputs():
        o1 = op.step(x1, pool, backend, state_indices=table1)
    empty = [x[:, :0] for x in x1]
    _check_round(op, o1, pool, table1, empty, x1, s0, dtype)

    # round 2: sequence b accepted n_b of round 1's tokens (1 .. T, every count appears)
    accepted = torch.tensor([1, T, 2][:B], dtype=torch.int64)
    x2 = op.tokens(dtype)
    with poison_outputs():
        o2 = op.step(x2, pool, backend, state_indices=table2, num_accepted_tokens=accepted.to(torch.int32))
    for b in range(B):
        n = int(accepted[b])
        hist = [x[b:b + 1, :n] for x in x1]
        _check_round(_row_op(op, b), o2[b:b + 1], pool, table2[b:b + 1], hist, [x[b:b + 1] for x in x2],
                     s0[b:b + 1], dtype)
    assert (pool[untouched] == 7.0).all(), "a slot outside the tables was written"


def _row_op(op, b):
    """``op`` restricted to one sequence (batch 1), sharing its reference and shapes."""
    one = Op.__new__(Op)
    one.__dict__.update(op.__dict__)
    one.B = 1
    return one


@pytest.mark.parametrize("which", ["kda", "diag"])
@pytest.mark.parametrize("backend,dt", [("torch", "fp64"), ("triton", "fp32")])
def test_one_column_table_equals_per_sequence_slots(which, backend, dt):
    """(B, 1) slots (a speculative table of width 1, as a non-speculative step of an engine) == (B,) slots."""
    op = Op(which, B=3, T=1, seed=5)
    dtype = DT[dt]
    pool_dtype = reference.accumulation_dtype(dtype)
    p1 = torch.randn(6, *op.state_shape, generator=op.gen, dtype=pool_dtype)
    p2 = p1.clone()
    slots = torch.tensor([4, 0, 2])
    xs = op.tokens(dtype)
    o1 = op.step(xs, p1, backend, state_indices=slots)
    o2 = op.step(xs, p2, backend, state_indices=slots.view(3, 1), num_accepted_tokens=torch.ones(3, dtype=torch.int32))
    assert torch.equal(o1, o2) and torch.equal(p1, p2)


# ---------------------------------------------------------------------------------------------- validation

def _named_error_cases():
    B, T = 2, 3
    good = torch.arange(B * T).view(B, T)
    return [
        ("table width", dict(state_indices=torch.arange(8).view(2, 4)), ValueError,
         r"state_indices must have shape \(2, 3\)"),
        ("table rank", dict(state_indices=torch.arange(12).view(2, 3, 2)), ValueError,
         r"state_indices must have shape"),
        ("table range", dict(state_indices=good + 10), ValueError, r"state_indices must lie in \[0, 12\)"),
        ("table repeat", dict(state_indices=torch.tensor([[0, 1, 2], [3, 4, 1]])), ValueError, r"must not repeat"),
        ("table dtype", dict(state_indices=good.float()), TypeError, r"state_indices must be int32 or int64"),
        ("accepted without table", dict(state_indices=torch.tensor([0, 5]),
                                        num_accepted_tokens=torch.ones(2, dtype=torch.int32)),
         ValueError, r"num_accepted_tokens needs state_indices of shape \(B, T\)"),
        ("accepted without indices", dict(num_accepted_tokens=torch.ones(2, dtype=torch.int32)), ValueError,
         r"num_accepted_tokens needs state_indices"),
        ("accepted zero", dict(state_indices=good, num_accepted_tokens=torch.tensor([0, 1])), ValueError,
         r"num_accepted_tokens must lie in \[1, 3\]"),
        ("accepted above T", dict(state_indices=good, num_accepted_tokens=torch.tensor([3, 4])), ValueError,
         r"num_accepted_tokens must lie in \[1, 3\]"),
        ("accepted dtype", dict(state_indices=good, num_accepted_tokens=torch.tensor([1.0, 2.0])), TypeError,
         r"num_accepted_tokens must be int32 or int64"),
        ("accepted shape", dict(state_indices=good, num_accepted_tokens=torch.tensor([1, 2, 3])), ValueError,
         r"num_accepted_tokens must have shape \(2,\)"),
        ("accepted device", dict(state_indices=good, num_accepted_tokens=torch.tensor([1, 2], device="meta")),
         ValueError, r"num_accepted_tokens must be on the device"),
    ]


@pytest.mark.parametrize("which", ["kda", "diag"])
@pytest.mark.parametrize("name,kw,exc,match", _named_error_cases(), ids=[c[0] for c in _named_error_cases()])
def test_bad_slots_are_named_errors(which, name, kw, exc, match):
    op = Op(which, B=2, T=3)
    pool = torch.zeros(12, *op.state_shape)
    with pytest.raises(exc, match=match):
        op.step(op.tokens(torch.float32), pool, "torch", **kw)


# ---------------------------------------------------------------------------------------------- graph capture

def _forbid_host_reads(monkeypatch):
    """Every way a tensor's values reach the host in Python raises (what a captured graph cannot hold)."""
    def boom(*a, **k):
        raise AssertionError("a tensor was read on the host")
    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "nonzero", boom)


@pytest.mark.parametrize("which", ["kda", "diag"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_under_capture_no_value_check_runs_and_nothing_is_read_on_the_host(monkeypatch, which, backend):
    op = Op(which, B=2, T=3, seed=3)
    table = torch.tensor([[5, 1, 3], [0, 4, 2]], dtype=torch.int32)
    accepted = torch.tensor([2, 3], dtype=torch.int32)
    xs = op.tokens(torch.float32)
    pool = torch.randn(7, *op.state_shape, generator=op.gen)
    expected_pool = pool.clone()
    expected = op.step(xs, expected_pool, "torch", state_indices=table, num_accepted_tokens=accepted)

    calls = []
    monkeypatch.setattr(_checks, "state_indices_values", lambda *a: calls.append(a))
    op.step(xs, pool.clone(), backend, state_indices=table, num_accepted_tokens=accepted)
    assert len(calls) == 1, "outside capture the value check must run once"

    monkeypatch.setattr(_checks, "_capturing", lambda: True)
    calls.clear()
    _forbid_host_reads(monkeypatch)
    o = op.step(xs, pool, backend, state_indices=table, num_accepted_tokens=accepted)
    assert calls == [], "a host-reading value check ran under capture"
    monkeypatch.undo()
    assert torch.allclose(o, expected, atol=2e-5, rtol=1e-4)
    assert torch.allclose(pool, expected_pool, atol=2e-5, rtol=1e-4)


def test_under_capture_shape_and_dtype_checks_still_run(monkeypatch):
    monkeypatch.setattr(_checks, "_capturing", lambda: True)
    op = Op("kda", B=2, T=3)
    pool = torch.zeros(12, *op.state_shape)
    xs = op.tokens(torch.float32)
    with pytest.raises(ValueError, match=r"state_indices must have shape \(2, 3\)"):
        op.step(xs, pool, "torch", state_indices=torch.arange(8).view(2, 4))
    with pytest.raises(TypeError, match="num_accepted_tokens must be int32 or int64"):
        op.step(xs, pool, "torch", state_indices=torch.arange(6).view(2, 3), num_accepted_tokens=torch.ones(2))
    # values are not read: an out-of-range count passes validation under capture (documented)
    _checks.state_indices(torch.arange(6).view(2, 3), 2, 12, torch.device("cpu"), 3, torch.tensor([0, 9]))


# ---------------------------------------------------------------------------------------------- launch configs

@pytest.mark.parametrize("which,dims,config", [
    ("kda", (16, 32), dict(num_warps=1, BV=16)),        # two V blocks, no masks
    ("kda", (48, 32), dict(num_warps=2, BV=32)),        # K padded to 64: masked
    ("diag", (24,), dict(num_warps=1, BD=16)),                    # three channel blocks of H * D = 48
    ("diag", (24,), dict(num_warps=2, BD=32)),                    # a partial last block
])
def test_explicit_launch_configs_match_the_reference(which, dims, config):
    """The launchers take their config as an argument (the sweep's candidates): each gives the reference
    result with (B, T) slots and accepted counts."""
    from delta_attn.ops._launch import tiles
    from delta_attn.ops.diag.launch import diag_step
    from delta_attn.ops.kda.launch import decode_step
    op = Op(which, B=2, T=3, seed=11)
    if which == "kda":
        op.K, op.V = dims
        op.state_shape = (op.HV, op.K, op.V)
    else:
        op.D = dims[0]
        op.state_shape = (op.H, op.D)
    xs = op.tokens(torch.float32)
    table = torch.tensor([[5, 1, 3], [0, 4, 2]], dtype=torch.int32)
    accepted = torch.tensor([3, 2], dtype=torch.int32)
    pool = torch.randn(7, *op.state_shape, generator=op.gen)
    expected_pool = pool.clone()
    expected = op.step(xs, expected_pool, "torch", state_indices=table, num_accepted_tokens=accepted)
    cfg = tiles("test", **config)
    with poison_outputs():
        if which == "kda":
            o = decode_step(*xs, pool, table, None, None, op.K ** -0.5, None, True, accepted, config=cfg)
        else:
            o = diag_step(*xs, pool, table, accepted, config=cfg)
    assert torch.allclose(o, expected, atol=2e-5, rtol=1e-4)
    assert torch.allclose(pool, expected_pool, atol=2e-5, rtol=1e-4)
