"""Backend registry: capabilities, readable reasons, explicit-backend errors, auto order, explain()."""
import pytest
import torch

import delta_attn as da
from delta_attn import backends
from delta_attn.backends import Backend, Call, Capability, UnsupportedError


def fake_call(**over):
    kw = dict(op="flash", device=torch.device("cuda"), dtype=torch.bfloat16, head_dims=(128, 128),
              features=frozenset({"causal"}), needs_grad=True)
    kw.update(over)
    return Call(**kw)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA device of compute capability 8.0 is present."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "device_capability", lambda device: (8, 0))


def make_backend():
    b = Backend("fake", "a test backend")
    b.register("flash", Capability(impl="builtins:len", dtypes=(torch.float16,), features=frozenset({"causal"}),
                                   backward=False, min_compute_capability=(9, 0), requires=("no_such_module_xyz",),
                                   install_hint="pip install xyz",
                                   head_dims=lambda dims: None if dims[0] <= 64 else f"head dim <= 64, got {dims[0]}"))
    return b


def test_reasons_name_every_unmet_requirement(fake_gpu):
    reasons = make_backend().not_supported_reasons(fake_call(features=frozenset({"causal", "softcap"})))
    text = " | ".join(reasons)
    assert "no_such_module_xyz not installed — pip install xyz" in text
    assert "compute capability >= 9.0, device has 8.0" in text
    assert "supports float16, got bfloat16" in text
    assert "head dim <= 64, got 128" in text
    assert "does not support softcap" in text
    assert "no backward pass" in text
    assert len(reasons) == 6


def test_reasons_for_missing_op_and_device():
    b = make_backend()
    assert b.not_supported_reasons(fake_call(op="kda")) == ["has no implementation of kda"]
    r = b.not_supported_reasons(fake_call(device=torch.device("cpu")))
    assert any("runs on cuda tensors, got cpu" in x for x in r)


def test_triton_backend_accepts_cpu_only_under_interpreter(monkeypatch):
    rule = backends._triton_device_rule
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert rule(fake_call(device=cpu, dtype=torch.float16))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert rule(fake_call(device=cpu, dtype=torch.float16)) == []
    # the interpreter computes bf16 wrongly (tl.dot, truncating casts): every op declares so, on CPU only
    for op in ("flash", "flash_varlen", "flash_kvcache", "kda", "diag", "diag_step", "kda_step"):
        why = rule(fake_call(op=op, device=cpu))
        assert len(why) == 1 and "interpreter" in why[0] and "bfloat16" in why[0] and "Triton " in why[0], why
    assert rule(fake_call()) == []                       # bf16 on a GPU


def test_device_specific_capability_replaces_the_general_one_on_its_device(fake_gpu):
    b = Backend("fake", "a test backend")
    b.register("flash", Capability(impl="builtins:len", dtypes=(torch.float16,)))
    b.register("flash", Capability(impl="builtins:len", device_types=("cpu",), dtypes=(torch.float32,),
                                   features=frozenset({"causal"})), device_type="cpu")
    cpu = fake_call(device=torch.device("cpu"), dtype=torch.float32)
    assert b.not_supported_reasons(cpu) == []
    assert any("supports float16, got float32" in r for r in b.not_supported_reasons(fake_call(dtype=torch.float32)))
    assert b.not_supported_reasons(fake_call(dtype=torch.float16, needs_grad=False)) == ["does not support causal"]
    assert b.device_types("flash") == ("cuda", "cpu")
    assert "runs on cuda/cpu tensors, got mps" in b.not_supported_reasons(fake_call(device=torch.device("mps")))
    assert b.implementation("flash") is len
    with pytest.raises(ValueError, match="same implementation"):
        b.register("flash", Capability(impl="builtins:max", device_types=("cpu",)), device_type="cpu")
    with pytest.raises(ValueError, match="must list 'cpu'"):
        b.register("flash", Capability(impl="builtins:len"), device_type="cpu")


def test_sdpa_declares_its_cpu_kernel_separately_from_its_cuda_kernels():
    sdpa = backends.BACKENDS["sdpa"]
    for op in ("flash", "flash_varlen"):
        cpu, cuda = sdpa.capability(op, "cpu"), sdpa.capability(op, "cuda")
        assert cpu.device_types == ("cpu",) and cuda.device_types == ("cuda",) and cpu.impl == cuda.impl
        assert torch.float32 in cpu.dtypes and torch.float64 in cpu.dtypes
        assert not cpu.features & {"softcap", "alibi", "dropout", "head_dim_v"}
    assert not sdpa.capability("flash_varlen", "cpu").traceable      # the host loop over cu_seqlens


def test_explicit_backend_raises_one_error_with_all_reasons(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "sdpa", make_backend())
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(UnsupportedError) as e:
        da.flash_attn_func(q, q, q, backend="sdpa")
    msg = str(e.value)
    assert "backend 'sdpa' cannot run flash" in msg and "not installed" in msg and "runs on cuda" in msg
    assert isinstance(e.value, ValueError) and isinstance(e.value, NotImplementedError)


def test_auto_walks_the_policy_and_explains(monkeypatch):
    q = torch.randn(1, 4, 2, 16)
    ex = da.explain(da.flash_attn_func, q, q, q, causal=True)
    # on CPU, PyTorch SDPA's CPU kernel comes first; the reference path comes last
    assert ex.chosen == "sdpa" and ex.requested == "auto"
    names = [n for n, _ in ex.considered]
    assert names[0] == "sdpa" and names.index("torch") == len(names) - 1
    text = str(ex)
    assert "chosen: sdpa" in text and "cpu: PyTorch SDPA's CPU kernel first" in text
    assert "torch: could run it, lower in the policy order" in text
    for name, reasons in ex.considered[1:-1]:
        assert reasons and f"{name}: passed over" in text
    # softcap: only the reference computes it on CPU, and explain() says why the others cannot
    ex = da.explain(da.flash_attn_func, q, q, q, causal=True, softcap=2.0)
    assert ex.chosen == "torch" and "sdpa: passed over — does not support softcap" in str(ex)
    # a custom policy reorders, and explain() reflects it
    monkeypatch.setitem(backends._POLICIES, "flash", lambda call: ("torch",))
    assert da.explain("flash_attn_func", q, q, q).considered[0][0] == "torch"


def test_explain_validates_like_the_call():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="softcap"):
        da.explain(da.flash_attn_func, q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="op must be one of"):
        da.explain(len, q)


def test_auto_warns_once_when_a_gpu_call_lands_on_the_reference(fake_gpu, monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    call = fake_call(op="kda", head_dims=(64, 64), features=frozenset(), needs_grad=False)
    order = backends.auto_order(call)
    blocked = {n: ["blocked in this test"] for n in order if n != "torch"}
    for n in blocked:
        monkeypatch.setattr(backends.BACKENDS[n], "not_supported_reasons", lambda c, n=n: blocked[n])
    with pytest.warns(backends.ReferenceFallbackWarning, match="blocked in this test"):
        backends.select(call)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backends.select(call)           # second time: silent


def test_unknown_op_registration_is_refused():
    with pytest.raises(ValueError, match="unknown operator"):
        Backend("x", "").register("softmax", Capability(impl="a:b"))


def test_every_registered_capability_points_at_a_real_function():
    for backend in backends.BACKENDS.values():
        for op, cap in backend.capabilities.items():
            module, _, attr = cap.impl.partition(":")
            assert module.startswith("delta_attn."), cap.impl
            # the torch backend must load anywhere; others may need their package
            if backend.name == "torch":
                assert callable(backend.implementation(op))


def test_untraceable_backends_are_passed_over_under_torch_compile(fake_gpu):
    """cudnn-frontend graphs run from Python: under torch.compile auto must pick a traceable path."""
    from delta_attn.backends import BACKENDS
    varlen = fake_call(op="flash_varlen", features=frozenset({"causal", "varlen"}), compiling=True)
    assert "cannot be traced by torch.compile" in BACKENDS["cudnn"].not_supported_reasons(varlen)
    gqa = fake_call(features=frozenset({"causal", "gqa"}), compiling=True)
    assert any("torch.compile cannot trace" in r for r in BACKENDS["cudnn"].not_supported_reasons(gqa))
    assert not any("trace" in r for r in BACKENDS["cudnn"].not_supported_reasons(fake_call(compiling=False)))


def test_select_tells_the_registry_when_it_is_traced(monkeypatch):
    seen = []
    real = backends._choose

    def spy(*args):
        seen.append(args[6])             # the `compiling` argument
        return real(*args)
    spy = torch.compiler.assume_constant_result(spy)
    monkeypatch.setattr(backends, "_choose", spy)
    x = torch.randn(1, 4, 2, 8)
    da.flash_attn_func(x, x, x, backend="torch")
    torch.compile(lambda t: da.flash_attn_func(t, t, t, backend="torch"), fullgraph=True, backend="eager")(x)
    assert seen[0] is False and True in seen[1:]


def test_choose_is_marked_as_the_public_decorator_marks():
    """backends.trace_constant stands in for torch.compiler.assume_constant_result without importing
    torch._dynamo at `import delta_attn`: it must mark a function exactly as the installed torch's decorator does."""
    def probe():
        return 0
    marks = vars(torch.compiler.assume_constant_result(probe))
    assert marks, "torch.compiler.assume_constant_result no longer marks the function: revisit backends.py"
    assert {k: getattr(backends._choose, k, None) for k in marks} == marks


def test_capability_checks_trace_under_torch_compile(monkeypatch):
    """auto for kda asks cuDNN's capability (its `requires` packages among it) while torch.compile traces the call:
    the package lookup must be a trace-time constant. torch 2.11's dynamo refuses to trace importlib's find_spec
    (newer ones trace it); a find_spec that breaks the graph when traced (a no-op when run) stands for that here."""
    import importlib.util

    import torch._dynamo
    from delta_attn.backends import BACKENDS
    real, graph_break = importlib.util.find_spec, torch._dynamo.graph_break

    def find_spec(name, package=None):
        graph_break()
        return real(name, package)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    call = fake_call(op="kda", dtype=torch.bfloat16, features=frozenset(), seqlen=64)

    def fn(x):
        return x + 1 if BACKENDS["cudnn"].not_supported_reasons(call) else x - 1
    x = torch.zeros(3)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(x), fn(x))


def test_cudnn_probes_trace_under_torch_compile(monkeypatch):
    """cuDNN's KDA probes (the frontend import, the NVRTC toolchain) run while torch.compile traces a CUDA call
    that ``auto`` may send to cuDNN (the hybrid model's KDA layers): dynamo refuses to trace an import, so they must
    be trace-time constants. Here the frontend is not installed and its import fails, as a traced import would."""
    from delta_attn.ops.kda import cudnn

    monkeypatch.setattr(cudnn, "_PROBES", {})
    monkeypatch.setattr(cudnn.B, "package_available", lambda module: True)
    call = fake_call(op="kda", dtype=torch.bfloat16, head_dims=(64, 64), features=frozenset(), seqlen=64)

    def fn(x):
        return x + len(cudnn.check(call))
    x = torch.zeros(3)
    torch._dynamo.reset()
    expected = fn(x)
    monkeypatch.setattr(cudnn, "_PROBES", {})
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(x), expected)
    assert "frontend" in cudnn._PROBES      # probed while tracing (a constant of the graph), not skipped
