"""The host-side caches of an eager call: the dispatcher's cache of choices, the memoized static checks of
``kda`` and the decode steps (``_checks.memoized``) and the launch layer's fitted tiles. None may change what a
call chooses or which input it refuses, nor launch a kernel past the device's shared memory."""
import contextlib

import pytest
import torch

import delta_attn as da
from delta_attn import _checks as C
from delta_attn import backends
from delta_attn.ops._launch import cdiv, halving, next_pow2, tiles


def _kda_inputs(B=2, H=1, K=16):
    q, k, v = torch.randn(3, B, 1, H, K).unbind(0)
    return q, k, v, -torch.rand(B, 1, H, K), torch.rand(B, 1, H), torch.zeros(B, H, K, K)


def test_choice_cache_follows_triton_interpret(monkeypatch):
    q, k, v, g, beta, pool = _kda_inputs()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert da.explain(da.kda_step, q, k, v, g, beta, pool).chosen == "triton"
    backends.select(backends.Call("kda_step", q.device, q.dtype, (16, 16)))      # cached: triton
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    name = backends._choose("kda_step", q.device, q.dtype, (16, 16), (), False, False, 0, "auto")
    assert name == "torch"                  # the interpreter is part of the key: not the cached triton


def test_choice_cache_cleared_by_register(monkeypatch):
    call = ("kda_step", torch.device("cpu"), torch.float32, (16, 16), (), False, False, 0, "auto")
    first = backends._choose(*call)
    assert backends._CHOSEN                  # cached
    cap = backends.BACKENDS["torch"].capabilities["kda_step"]
    monkeypatch.setitem(backends.BACKENDS["torch"].capabilities, "kda_step", cap)
    backends.register("torch", "kda_step", cap)
    assert not backends._CHOSEN              # register forgets every choice
    assert backends._choose(*call) == first


def test_unsupported_is_never_cached():
    call = ("kda_step", torch.device("cpu"), torch.float32, (16, 16), (), True, False, 0, "triton")
    for _ in range(2):
        with pytest.raises(backends.UnsupportedError, match="backward"):
            backends._choose(*call)
    assert not backends._CHOSEN


@pytest.mark.parametrize("op", ["kda_step", "gated_diag_step"])
def test_memoized_checks_still_refuse_bad_input(op):
    q, k, v, g, beta, pool = _kda_inputs()
    run = ((lambda **kw: da.kda_step(q, k, v, g, beta, pool, backend="torch", **kw)) if op == "kda_step" else
           (lambda **kw: da.gated_diag_step(q, k, v, g, pool[..., 0], backend="torch", **kw)))
    run()
    run()                                    # the second call takes the remembered signature
    for _ in range(2):                       # a slot out of range: value checks run on every call
        with pytest.raises(ValueError, match=r"state_indices must lie in \[0, 2\)"):
            run(state_indices=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="state_indices must have shape"):
        run(state_indices=torch.tensor([0, 1, 2]))
    if op == "kda_step":
        run(scale=0.5)
        for bad, err in ((float("nan"), ValueError), (True, TypeError)):
            for _ in range(2):               # never remembered: raises on every call
                with pytest.raises(err, match="scale"):
                    run(scale=bad)
        run(use_qk_l2norm=True)
        with pytest.raises(TypeError, match="use_qk_l2norm must be a bool"):
            run(use_qk_l2norm=1)             # 1 == True, but the type is in the signature


def test_kda_memoized_checks_still_refuse_bad_input():
    q, k, v, g, beta, _ = _kda_inputs()
    run = lambda **kw: da.kda(**{**dict(q=q, k=k, v=v, g=g, beta=beta, backend="torch"), **kw})  # noqa: E731
    run()
    run()                                    # the second call takes the remembered signature
    for _ in range(2):                       # g's values: checked on every call
        with pytest.raises(ValueError, match="g is a log decay and must be <= 0"):
            run(g=g.abs() + 0.5)
        with pytest.raises(ValueError, match="cu_seqlens"):
            run(q=q.reshape(1, 2, 1, 16), k=k.reshape(1, 2, 1, 16), v=v.reshape(1, 2, 1, 16),
                g=g.reshape(1, 2, 1, 16), beta=beta.reshape(1, 2, 1), cu_seqlens=torch.tensor([0, 3, 2]))
        for bad, err in ((float("nan"), ValueError), (True, TypeError)):
            with pytest.raises(err, match="scale"):
                run(scale=bad)
        with pytest.raises(ValueError, match="g must have shape"):
            run(g=g[:, :, :, :8])
        with pytest.raises(TypeError, match="use_qk_l2norm must be a bool"):
            run(use_qk_l2norm=1)
    run(scale=0.5)


def test_memoized_skips_only_identical_signatures():
    seen = []

    def check(*args):
        seen.append(args)
        return len(seen)

    x = torch.zeros(2, 3)
    assert C.memoized("t", check, x, 1.0) == C.memoized("t", check, torch.ones(2, 3), 1.0) == 1
    assert C.memoized("t", check, x.double(), 1.0) == 2             # dtype
    assert C.memoized("t", check, torch.zeros(3, 2), 1.0) == 3      # shape
    assert C.memoized("t", check, x, 1) == 4                        # int vs float
    assert C.memoized("t", check, x, [1.0]) == 5                    # unhashable: every time
    assert C.memoized("t", check, x, [1.0]) == 6


def test_launch_helpers():
    import triton
    assert all(next_pow2(n) == triton.next_power_of_2(n) for n in range(0, 1100))
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 200) for b in range(1, 33))
    first = tiles("t", BV=64)
    assert halving(first, ("BV",)) is halving(first, ("BV",))       # cached
    assert [t.get("BV") for t in halving(first, ("BV",))] == [64, 32, 16]


def test_kvcache_memoized_checks_still_refuse_bad_input():
    q, k_cache, v_cache = torch.randn(2, 1, 2, 16), torch.zeros(2, 8, 1, 16), torch.zeros(2, 8, 1, 16)
    k, v = torch.randn(2, 2, 1, 1, 16).unbind(0)
    run = lambda **kw: da.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, backend="torch", **kw)  # noqa: E731
    lens = torch.tensor([3, 5], dtype=torch.int32)
    out = run(cache_seqlens=lens, causal=True)
    assert torch.equal(out, run(cache_seqlens=lens, causal=True, window_size=[-1, 0]))   # a list: checked in full
    for _ in range(2):
        with pytest.raises(ValueError, match="the cache is too short"):
            run(cache_seqlens=torch.tensor([3, 8], dtype=torch.int32), causal=True)    # a value: every call
        with pytest.raises(ValueError, match="the cache is too short"):
            run(cache_seqlens=8, causal=True)                                          # an int: in the signature
        with pytest.raises(TypeError, match="causal must be a bool"):
            run(cache_seqlens=lens, causal=1)
    run(cache_seqlens=7)


def test_fitted_tiles_follow_the_triton_specialisation(monkeypatch):
    """The tiles fitted to the shared memory are cached per specialisation Triton compiles: an int argument that is
    a multiple of 16 in one call and not in the next (or a tensor address aligned or not) compiles another kernel,
    whose need may differ; the cached fit of the first must not launch the second past the limit."""
    from delta_attn.ops import _launch

    class Kernel:                      # needs twice the shared memory where its int argument is not a multiple of 16
        def __init__(self):
            self.launched = []

        def warmup(self, x, n, grid, BLOCK, num_warps, num_stages):
            shared = BLOCK * 1024 * (1 if n % 16 == 0 else 2)
            return type("Compiled", (), {"metadata": type("M", (), {"shared": shared})(),
                                         "_init_handles": lambda self: None})()

        def __getitem__(self, grid):
            return lambda x, n, BLOCK, num_warps, num_stages: self.launched.append((n, BLOCK))

    monkeypatch.setattr(_launch, "shared_memory", lambda device: 160 * 1024)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    kernel, x, cuda = Kernel(), torch.zeros(4), torch.device("cuda", 0)
    candidates = (tiles("big", BLOCK=128), tiles("small", BLOCK=64))
    for n in (256, 300, 512, 301):
        _launch._run(_launch._Launch(kernel, lambda t: (1,), (x, n), {}, candidates, cuda))
    assert kernel.launched == [(256, 128), (300, 64), (512, 128), (301, 64)]
    unaligned = torch.zeros(5)[1:]      # 4 bytes past an aligned address

    def key(*args):
        return _launch._fitted_key(kernel, args, {}, candidates, 0)
    assert key(x, 7) != key(unaligned, 7)
    assert len({key(x, 1), key(x, 17), key(x, 32)}) == 3
    assert key(x, 17) == key(x, 19) and key(x, True) != key(x, 1)
