"""KDA on the Triton backend, run by the interpreter on CPU (fp32 / fp16; bf16 only on the GPU).

Every result is compared with the float64 reference under the error rule of docs/TESTING.md (the same computation in
the input dtype is the baseline), with outputs poisoned first: 300 seeded random configurations
(``properties.draw_kda``; the last 100 with --slow), both inference chunk lengths and both intra-chunk factorisations
forced, the structural identities (chunked == recurrent, two halves == one pass, prefill + decode == whole), the
custom ops' fake implementations and autograd (``torch.library.opcheck``), and the named errors.
"""
import types

import properties
import pytest
import torch
import triton
import triton.language as tl

import delta_attn as da
from delta_attn.backends import UnsupportedError
from delta_attn.ops import _launch
from delta_attn.ops.kda import launch
from delta_attn.ops.kda.kernels_intra import _kda_tri_inverse_dots

CPU_CASES = 300
DEFAULT_CASES = 200       # the seeds from here on run with --slow (they keep the CPU suite near 10 minutes)


@pytest.mark.parametrize("seed", [s if s < DEFAULT_CASES else pytest.param(s, marks=pytest.mark.slow)
                                  for s in range(CPU_CASES)])
def test_random_configuration(seed):
    case = properties.draw_kda(seed, "cpu")
    bad = properties.kda_check(case)
    assert not bad, f"{case}: " + "; ".join(bad)


def _case(seed, **over):
    c = properties.draw_kda(seed, "cpu")
    return properties.KDACase(**{**c.__dict__, **over})


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("decay", [None, -1e4, float("-inf")])
def test_inference_chunk_lengths(monkeypatch, chunk, decay):
    """The inference chunk length is chosen by shape (16, or 32 for few long sequences): force each."""
    monkeypatch.setattr(launch, "infer_chunk", lambda *a: chunk)
    c = _case(7, T=77, cu=None, B=2, K=48, V=32, decay=decay, gate=None, grad=False, h0=True, final=True,
              dtype="fp16")
    assert not properties.kda_check(c)


@pytest.mark.parametrize("factor_max", [-1.0, 1e9])
@pytest.mark.parametrize("grad", [False, True])
def test_exact_and_factored_products(monkeypatch, factor_max, grad):
    """Each chunk forms exp(G_i - G_j) factored (every |G| <= FACTOR_MAX and, for fp32 gate gradients, every
    cumulative gate tangent <= TANGENT_MAX) or exactly: force each in turn (forward and backward). Half the
    channels decay by ~1.5 per token (~96 per 64-token chunk: exp(96) overflows fp32, so only the middle-token
    reference keeps the factored path finite)."""
    monkeypatch.setattr(launch, "FACTOR_MAX", factor_max)
    monkeypatch.setattr(launch, "TANGENT_MAX", factor_max)
    c = _case(11, B=2, T=130, cu=None, H=1, HV=2, K=32, V=16, dtype="fp32", gate="softplus", l2=True, h0=True,
              final=True, grad=grad)
    assert not properties.kda_check(c)


def test_gate_parameter_gradients_strong_decay():
    """fp32 dA_log and d dt_bias stay fp32-accurate where every token decays strongly (gate input + 3: log decays
    of about -4 a token, hundreds over a 64-token chunk) and a tenth of the tokens reset (gate input + 40: below the
    floor), with GVA (HV = 2H), K 16, V 48. Formed as sum_t (d decay_t / d A_log) dd_t, the rounding of every
    per-token term of dd was weighted by the cumulative decay (here dA_log 3.7x over the error rule: the error was
    all in the intra-chunk backward, fp32 against fp64 on the same inputs); the kernel weights each term by the
    decay over the tokens it spans instead (``kernels_gate._kda_tangent_sum``)."""
    seed = 1
    c = _case(seed, B=1, T=64, cu=None, H=1, HV=2, K=16, V=48, dtype="fp32", gate="softplus", l2=True, h0=False,
              final=False, grad=True, scale=None, decay=None, fp32_gb=False)
    xs, kw = properties.kda_inputs(c, "cpu")
    gen = torch.Generator().manual_seed(seed)
    reset = torch.rand(xs[3].shape[:3] + (1,), generator=gen) < 0.1
    xs[3] = xs[3] + torch.where(reset, 40.0, 3.0)
    bad, _ = properties.kda_compare(xs, kw, True, seed, use_qk_l2norm=True)
    assert not bad, f"{c}: " + "; ".join(bad)


@triton.jit
def _tri_inverse_kernel(A, T, BT: tl.constexpr):
    i = tl.arange(0, BT)
    a = tl.load(A + i[:, None] * BT + i[None, :])
    tl.store(T + i[:, None] * BT + i[None, :], _kda_tri_inverse_dots(a, BT, "ieee"))


@pytest.mark.parametrize("BT", [16, 32, 64])
@pytest.mark.parametrize("entries", ["uniform", "near one"])
def test_tri_inverse_dots_matches_inverse(BT, entries):
    """(I + A)^-1 by block merging for a strictly lower A (every chunk length the kernels use) with O(1) entries
    (uniform in [-1, 1]) or entries near 0.9 (nearly parallel keys, beta near 1, where the doubling product's terms
    C(BT - 2, BT / 2 - 1) a^(BT / 2) cancelled: 2.8e7 at 32 rows), against float64 inversion."""
    gen = torch.Generator().manual_seed(BT)
    noise = torch.rand(BT, BT, generator=gen)
    A = torch.tril(noise * 2 - 1 if entries == "uniform" else 0.85 + 0.1 * noise, -1)
    T = torch.full_like(A, float("nan"))
    _tri_inverse_kernel[(1,)](A, T, BT=BT)
    want = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + A.double())
    torch.testing.assert_close(T.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_pipeline_per_use(monkeypatch):
    """No gradient (grad mode off, or no input requiring grad): the inference pipeline; otherwise the
    training pipeline. Both compute the same function."""
    from delta_attn.ops.kda import autograd
    seen = []
    for name in ("infer_forward", "train_forward"):
        real = getattr(autograd, name)
        monkeypatch.setattr(autograd, name, lambda *a, _r=real, _n=name: seen.append(_n) or _r(*a))
    xs, kw = properties.kda_inputs(_case(3, B=1, T=40, cu=None, dtype="fp32", h0=True), "cpu")
    leaves = [x.detach().requires_grad_() for x in xs]
    with torch.no_grad():
        o1, s1 = da.kda(*leaves, use_qk_l2norm=True, output_final_state=True, backend="triton", **kw)
    o2, s2 = da.kda(*leaves, use_qk_l2norm=True, output_final_state=True, backend="triton", **kw)
    assert seen == ["infer_forward", "train_forward"]
    assert o1.grad_fn is None and o2.grad_fn is not None
    torch.testing.assert_close(o1, o2.detach(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s1, s2.detach(), atol=2e-5, rtol=1e-4)


def _step_all(xs, state, idx=None, chunk=1, **opts):
    outs = []
    for t0 in range(0, xs[0].shape[1], chunk):
        outs.append(da.kda_step(*[x[:, t0:t0 + chunk] for x in xs], state, state_indices=idx, backend="triton",
                                **opts))
    return torch.cat(outs, 1)


def test_chunked_equals_recurrent_and_halves():
    c = _case(5, B=2, T=45, cu=None, H=2, HV=4, K=16, V=32, dtype="fp32", gate="softplus", l2=True)
    xs, kw = properties.kda_inputs(c, "cpu")
    opts = dict(use_qk_l2norm=True, A_log=kw["A_log"], dt_bias=kw["dt_bias"])
    o, s = da.kda(*xs, output_final_state=True, backend="triton", **opts)
    state = torch.zeros(2, 4, 16, 32)
    o_rec = _step_all(xs, state, chunk=13, **opts)            # decode kernel, 13 tokens per call
    torch.testing.assert_close(o_rec, o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state, s, atol=2e-5, rtol=1e-4)
    o1, s1 = da.kda(*[x[:, :23] for x in xs], output_final_state=True, backend="triton", **opts)
    o2, s2 = da.kda(*[x[:, 23:] for x in xs], initial_state=s1, output_final_state=True, backend="triton", **opts)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s2, s, atol=2e-5, rtol=1e-4)


def test_prefill_then_decode_with_strided_state_indices():
    """Prefill, then decode from a pool through a strided ``state_indices`` view: other slots untouched."""
    c = _case(9, B=3, T=29, cu=None, H=1, HV=2, K=16, V=16, dtype="fp32", gate=None, decay=-1e4, l2=True)
    xs, _ = properties.kda_inputs(c, "cpu")
    o_all, _ = da.kda(*xs, use_qk_l2norm=True, backend="triton")
    _, s = da.kda(*[x[:, :20] for x in xs], output_final_state=True, use_qk_l2norm=True, backend="triton")
    pool = torch.full((7, 2, 16, 16), 123.0)
    idx = torch.tensor([5, 9, 0, 9, 3, 9], dtype=torch.int32)[::2]       # [5, 0, 3], stride 2
    pool[idx.long()] = s
    o_dec = _step_all([x[:, 20:] for x in xs], pool, idx, use_qk_l2norm=True)
    torch.testing.assert_close(o_dec, o_all[:, 20:], atol=2e-5, rtol=1e-4)
    assert (pool[[1, 2, 4, 6]] == 123.0).all()


def test_decode_several_tokens_matches_reference_with_strided_gate_parameters():
    c = _case(13, B=3, T=5, cu=None, H=1, HV=2, K=16, V=16, dtype="fp16", gate="softplus", l2=True)
    xs, kw = properties.kda_inputs(c, "cpu")
    a_log = torch.stack([kw["A_log"], torch.zeros(2)], 1)[:, 0]             # strided views
    dt_bias = torch.stack([kw["dt_bias"], torch.zeros(32)], 1)[:, 0]
    assert a_log.stride() != (1,) and dt_bias.stride() != (1,)
    idx = torch.tensor([5, 0, 3], dtype=torch.int32)
    p1 = torch.randn(7, 2, 16, 16)
    p2 = p1.clone()
    opts = dict(use_qk_l2norm=True, A_log=a_log, dt_bias=dt_bias)
    o1 = da.kda_step(*xs, p1, state_indices=idx, backend="triton", **opts)
    o2 = da.kda_step(*xs, p2, state_indices=idx, backend="torch", **opts)
    torch.testing.assert_close(o1, o2, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(p1, p2, atol=2e-3, rtol=2e-3)
    o3, _ = da.kda(*xs, backend="triton", **opts)
    o4, _ = da.kda(*xs, backend="torch", **opts)
    torch.testing.assert_close(o3, o4, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("K,V", [(40, 16), (16, 272)])
def test_unsupported_head_dim_is_a_named_error(K, V):
    xs, _ = properties.kda_inputs(_case(1, B=1, T=3, cu=None, K=K, V=V, dtype="fp32"), "cpu")
    with pytest.raises(UnsupportedError, match="head dim"):
        da.kda(*xs, backend="triton")


@pytest.mark.parametrize("bad", [dict(scale=float("inf")), dict(scale=float("nan")), dict(allow_tf32=1)])
def test_bad_options_are_named_errors(bad):
    xs, _ = properties.kda_inputs(_case(1, B=1, T=3, cu=None, K=16, V=16, dtype="fp32"), "cpu")
    name = next(iter(bad))
    with pytest.raises((ValueError, TypeError), match=name):
        da.kda(*xs, backend="triton", **bad)


def _op_args(varlen: bool):
    c = _case(17, B=1, T=21, H=1, HV=2, K=16, V=16, dtype="fp32", gate="lower_bound", h0=True,
              cu=(0, 5, 5, 21) if varlen else None)
    xs, kw = properties.kda_inputs(c, "cpu")
    return (*xs, kw["initial_state"], kw.get("cu_seqlens"), kw["A_log"], kw["dt_bias"], 0.25, -5.0, True, True,
            False)


@pytest.mark.parametrize("varlen", [False, True])
def test_custom_ops_fake_and_autograd(varlen):
    """torch.library.opcheck: schema, fake implementation (shapes from shapes only: the saved per-chunk
    tensors are sized by an upper bound of the chunk count). Autograd is KDAFunction's (the pattern of every
    op), checked by the gradient tests and by the torch.compile test below."""
    from delta_attn.ops.kda import autograd  # noqa: F401  (registers the ops)
    args = _op_args(varlen)
    torch.library.opcheck(torch.ops.delta_attn.kda_infer.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    train_args = tuple(a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
                       for a in args)
    torch.library.opcheck(torch.ops.delta_attn.kda_train.default, train_args,
                          test_utils=("test_schema", "test_faketensor"))


def test_fit_takes_the_first_tiles_that_fit_shared_memory():
    """The launch layer compiles candidates in order and takes the first within the limit; none: a named error."""
    class Compiled:
        def __init__(self, shared):
            self.metadata = type("M", (), {"shared": shared})()
            self.loaded = False

        def _init_handles(self):
            self.loaded = True

    class Kernel:
        __name__ = "_fake_kernel"

        def __init__(self):
            self.calls = []
            self.compiled = []

        def warmup(self, *args, grid, **kw):
            self.calls.append((grid, kw["BV"]))
            self.compiled.append(Compiled(1000 * kw["BV"]))
            return self.compiled[-1]

    first = _launch.tiles("tuned", num_stages=3, BV=64, BK=32)
    cands = _launch.halving(first, ("BV",))
    assert [dict(t.meta)["BV"] for t in cands] == [64, 64, 32, 16] and cands[1].num_stages == 1
    k = Kernel()
    t = _launch.fit(k, lambda t: (t.get("BV"),), (), {}, cands, 40_000)
    assert t.get("BV") == 32 and [c[1] for c in k.calls] == [64, 64, 32] and k.calls[-1][0] == (32,)
    # the chosen kernel is loaded (binary and launcher stub) where it was compiled; the others are not
    assert [c.loaded for c in k.compiled] == [False, False, True]
    with pytest.raises(RuntimeError, match="_fake_kernel.*10000 bytes"):
        _launch.fit(Kernel(), lambda t: (1,), (), {}, cands, 10_000)


def test_compiled_together_runs_launches_in_order_at_the_end():
    """Launches inside compiled_together run at the block's end, in order, with the host steps of in_launch_order
    in their places; compile_only launches and steps never run; a nested block joins the outer one; a block that
    raises runs nothing; outside a block a step runs at once."""
    ran = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: ran.append((self.name, grid, kw["BV"]))

    x = torch.zeros(1)
    cand = (_launch.tiles("t", BV=16),)
    with _launch.compiled_together():
        _launch.launch(Kernel("a"), lambda t: (1,), (x,), {}, cand)
        _launch.in_launch_order(lambda: ran.append("step"))
        with _launch.compiled_together():
            _launch.launch(Kernel("b"), lambda t: (2,), (x,), {}, cand)
        with _launch.compile_only(x.device):
            _launch.launch(Kernel("ahead"), lambda t: (3,), (x.to("meta"),), {}, cand)
            _launch.in_launch_order(lambda: ran.append("ahead step"))
        assert ran == []
    assert ran == [("a", (1,), 16), "step", ("b", (2,), 16)]
    ran.clear()
    with pytest.raises(ValueError):
        with _launch.compiled_together():
            _launch.launch(Kernel("c"), lambda t: (1,), (x,), {}, cand)
            _launch.in_launch_order(lambda: ran.append("step"))
            raise ValueError
    assert ran == []
    _launch.in_launch_order(lambda: ran.append("now"))
    assert ran == ["now"]
    ran.clear()
    with pytest.raises(RuntimeError, match="inside compiled_together"):
        with _launch.compile_only(x.device):
            pass
    assert _launch.launch(Kernel("d"), lambda t: (1,), (x,), {}, cand).get("BV") == 16 and ran == [("d", (1,), 16)]


def test_jit_state_is_created_before_the_compile_threads(monkeypatch):
    """_prime_jit creates a kernel's per-device JIT state in the calling thread (threads compiling two variants
    of one kernel would otherwise each create one and lose a compiled kernel); a kernel without one is left."""
    import collections
    import contextlib
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    kernel = types.SimpleNamespace(device_caches=collections.defaultdict(dict))
    _launch._prime_jit(kernel, torch.device("cuda", 3))
    assert list(kernel.device_caches) == [3]
    _launch._prime_jit(object(), torch.device("cuda", 3))


def test_precision_rules():
    """fp32: IEEE dots unless allow_tf32; bf16: tf32 on fp32 tiles, bf16 operands for the forward intra-chunk
    products; fp16: exact per-chunk dots. tf32 on fp32 tiles only for K <= 128 (IEEE beyond)."""
    p = launch.precision
    assert (p(torch.float32, False, 64).dot, p(torch.float32, False, 64).scan) == ("ieee", "ieee")
    assert (p(torch.float32, True, 128).dot, p(torch.float32, True, 128).scan) == ("tf32", "tf32")
    assert p(torch.bfloat16, False, 64).work == torch.bfloat16 and p(torch.bfloat16, False, 64).dot == "tf32"
    # the forward intra-chunk products and UT transform: bf16 operands for bf16 inputs, the input dtype otherwise
    assert [p(dt, False, 64, train=t).intra_op for dt in (torch.bfloat16, torch.float16, torch.float32)
            for t in (False, True)] == [tl.bfloat16] * 2 + [tl.float32] * 4
    assert p(torch.float16, False, 64).dot == "ieee" and p(torch.float16, False, 64).work == torch.float32
    # fp16: forward scans in 3xTF32 (training: K <= 64, IEEE above), backward scans in IEEE
    assert (p(torch.float16, False, 128).fwd_scan, p(torch.float16, False, 128).scan) == ("tf32x3", "ieee")
    assert p(torch.float16, False, 64, train=True).fwd_scan == "tf32x3"
    assert p(torch.float16, False, 128, train=True).fwd_scan == "ieee"
    assert (p(torch.float16, False, 144).fwd_scan, p(torch.float16, False, 144).scan) == ("ieee", "ieee")
    assert (p(torch.float32, True, 192).dot, p(torch.float32, True, 192).scan) == ("ieee", "ieee")
    assert p(torch.bfloat16, False, 256).dot == "tf32"


def test_torch_compile_fullgraph_forward_and_backward():
    """KDAFunction (kda_train / kda_train_bwd custom ops) traces with fullgraph=True and gives eager's
    outputs and gradients bit for bit; the inference op too."""
    c = _case(5, B=1, T=19, H=1, HV=2, K=16, V=16, dtype="fp32", gate="softplus", h0=True, cu=(0, 7, 19))
    xs, kw = properties.kda_inputs(c, "cpu")
    leaves = [x.detach().requires_grad_() for x in xs]

    def f(*xs):
        o, s = da.kda(*xs, output_final_state=True, use_qk_l2norm=True, backend="triton", **kw)
        return o.square().sum() + s.sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    loss_e = f(*leaves)
    grads_e = torch.autograd.grad(loss_e, leaves)
    assert torch.equal(loss, loss_e)
    for a, b in zip(grads, grads_e):
        assert torch.equal(a, b)
    with torch.no_grad():             # the inference op (another pipeline: compared with its own eager run)
        assert torch.equal(compiled(*leaves), f(*leaves))


def test_decode_step_gluon_layout_and_choice(monkeypatch):
    """On CUDA the decode step runs the Gluon kernel (explicit layout: 16-byte vectors along V, the remaining
    lanes and the warps along K); on CPU, under the interpreter or without Gluon, the Triton kernel."""
    from delta_attn.ops import _gluon
    from delta_attn.ops.kda import kernels_decode as decode
    assert not _gluon.available(torch.device("cpu"))
    if _gluon.gluon is None:
        pytest.skip("this Triton has no Gluon (older than 3.6)")
    gl = _gluon.gl
    assert decode.step_layout(64, 4, 4) == gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    assert decode.step_layout(32, 2, 8) == gl.BlockedLayout([1, 2], [2, 16], [2, 1], [1, 0])
    assert decode.step_layout(4, 1, 4) == gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0])
    monkeypatch.setattr(_gluon.settings, "triton_interpreter", lambda: False)
    assert _gluon.available(torch.device("cuda"))
    monkeypatch.setattr(_gluon.settings, "triton_interpreter", lambda: True)
    assert not _gluon.available(torch.device("cuda"))
