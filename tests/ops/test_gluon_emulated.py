"""The Gluon kernels on the CPU emulator (``tests/gluon_emulator.py``): the fused KDA inference forward
(``ops/kda/kernels_fused.py``, both forms: one warpgroup, and warp-specialised) by the GPU suite's checks
(tests/gpu/test_kda_fused_gpu.py loaded again with the CPU as device: its 60 property configurations, planted exact
chunks) against the float64 reference with the error rule, and the emulator's own hazard checks on kernels that
break each rule."""
from __future__ import annotations

import pytest
import torch

from delta_attn.ops import _gluon

pytestmark = pytest.mark.skipif(_gluon.gluon is None, reason="Triton without Gluon")

if _gluon.gluon is not None:
    import gluon_emulator as E

FUSED = E.gpu_module_on_cpu("test_kda_fused_gpu") if _gluon.gluon is not None else None


@pytest.fixture
def cpu(monkeypatch):
    with E.on_cpu(monkeypatch):
        yield monkeypatch


FORMS = FUSED.FORMS if FUSED else ()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", FUSED.SEEDS if FUSED else [])
def test_fused_forward_property_configuration(seed, form, cpu):
    FUSED.test_property_configuration(seed, FUSED.spy_fused(cpu, form))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T,cu", [(1100, None), (0, (0, 300, 300, 317, 1024))])
def test_fused_forward_exact_chunks_between_factored_ones(T, cu, form, cpu):
    FUSED.test_exact_chunks_between_factored_ones(T, cu, FUSED.spy_fused(cpu, form))


@pytest.mark.parametrize("path", ["fused", "split"])
@pytest.mark.parametrize("cosine", ["0.5", "0.85", "0.99"])
def test_inference_forward_with_correlated_keys(path, cosine, cpu):
    FUSED.test_correlated_keys(path, cosine, FUSED.spy_fused(cpu, FORMS[0]), cpu)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("along", [1.0, 0.03])
def test_fused_forward_nearly_orthogonal_qk(T, along, form, cpu):
    FUSED.test_nearly_orthogonal_qk(T, along, FUSED.spy_fused(cpu, form))


def test_split_inference_one_token_bf16(cpu):
    """The split inference kernels with the GPU's bf16 arithmetic, one token (B 2, K = V = 16, softplus gate, q / k
    not normalised; CPU-domain property seed 260): Aqk's diagonal (decay 1) is q . k in fp32, not the product of the
    bf16-rounded factors q exp(G) and k exp(-G), which put the output 1.3x over the error rule."""
    import properties as P
    assert P.Checker(P.draw("kda", 260, "cpu"), "cpu").check("triton") == "ran"


@pytest.mark.parametrize("nan", [False, True])
def test_fused_forward_positive_decay_reduced_first(nan, cpu):
    FUSED.test_positive_decay_raises_after_the_launch("kda", nan, FUSED.spy_fused(cpu, FORMS[0]), cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("plant", [None, "first", "last"])
def test_positive_max_kernel(dtype, plant):
    """ops/_decay_max.py's reduction for the g <= 0 check: each program's max(0, its share), NaN read as 0, shares
    of whole stages with a partial last one and programs past the end, against torch."""
    from delta_attn.ops import _decay_max
    n, programs, block = 512 * 9 + 48, 4, 512
    per = -(-n // (programs * block)) * block
    gen = torch.Generator().manual_seed(3)
    x = (-torch.rand(n, generator=gen)).to(dtype)
    x[100] = float("nan")
    if plant == "first":
        x[0] = 0.5
    elif plant == "last":
        x[-1] = 0.25
    partial = torch.full((programs,), float("nan"))
    E.run_kernel(_decay_max._positive_max_kernel, (programs,), x, partial, n, per, BLOCK=block, STAGES=4,
                 num_warps=4)
    want = [x[i * per:(i + 1) * per].float().nan_to_num(0.0).clamp_min(0.0).max().item() if i * per < n else 0.0
            for i in range(programs)]
    assert partial.tolist() == want


# ---------------------------------------------------------------------------------------------------------------
# the emulator's hazard checks: one small kernel per rule, run correct and broken

if _gluon.gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    gl, gluon = _gluon.gl, _gluon.gluon

    @gluon.jit
    def _rules_kernel(x, y, N: gl.constexpr, BREAK: gl.constexpr):
        """y = x @ x^T for an [N, N] bf16 x: cp.async into shared memory, a register round trip (another thread
        mapping) through a second buffer, an asynchronous wgmma; BREAK names the rule the program breaks (0: none)."""
        L: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0])
        LT: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, 4], [0, 1])     # other threads' elements
        A: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
        i = gl.arange(0, N, layout=gl.SliceLayout(1, L))
        j = gl.arange(0, N, layout=gl.SliceLayout(0, L))
        a_s = gl.allocate_shared_memory(gl.bfloat16, [N, N], SH)
        b_s = gl.allocate_shared_memory(gl.bfloat16, [N, N], SH)
        off = i[:, None] * N + j[None, :]
        if BREAK == 5:
            off = off + 1                                   # reads one element past x
        async_copy.async_copy_global_to_shared(a_s, x + off)
        async_copy.commit_group()
        if BREAK != 1:
            async_copy.wait_group(0)                        # 1: the copy is read before it lands
        if BREAK != 2:
            gl.thread_barrier()                             # 2: other threads' copies read with no barrier
        b_s.store(a_s.load(LT))
        if BREAK != 3:
            fence_async_shared()                            # 3: the wgmma reads generic writes with no fence
        gl.thread_barrier()
        acc = warpgroup_mma(a_s, b_s.permute((1, 0)), gl.zeros([N, N], gl.float32, A), is_async=True)
        if BREAK == 4:
            b_s.store(gl.zeros([N, N], gl.bfloat16, L))    # 4: an operand overwritten while the wgmma reads it
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.store(y + off, gl.convert_layout(acc, L))


@pytest.mark.parametrize("broken", [0, 1, 2, 3, 4, 5])
def test_emulator_hazards(broken):
    N = 16
    x = torch.randn(N, N).to(torch.bfloat16)
    y = torch.zeros(N, N)
    if broken == 0:
        E.run_kernel(_rules_kernel, (1,), x, y, N=N, BREAK=0, num_warps=4)
        torch.testing.assert_close(y, (x.float() @ x.float().T), rtol=1e-5, atol=1e-5)
        return
    expect = {1: "in flight", 2: "no thread_barrier", 3: "no fence_async_shared", 4: "asynchronous wgmma reads",
              5: "out of bounds"}[broken]
    with pytest.raises(E.GluonHazard, match=expect):
        E.run_kernel(_rules_kernel, (1,), x, y, N=N, BREAK=broken, num_warps=4)


if _gluon.gluon is not None:
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    @gluon.jit
    def _ws_consumer(x_s, y, ready, empty, n, N: gl.constexpr, BREAK: gl.constexpr):
        L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        i = gl.arange(0, N, layout=L)
        for c in range(0, n):
            st = c % 2
            if BREAK != 1:
                mbarrier.wait(ready.index(st), (c // 2) & 1)   # 1: the stage read before it is ready
            gl.store(y + c * N + i, x_s.index(st).load(L))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(st), count=1)

    @gluon.jit
    def _ws_producer(x, x_s, ready, empty, n, N: gl.constexpr, BREAK: gl.constexpr):
        L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        i = gl.arange(0, N, layout=L)
        for c in range(0, n):
            st = c % 2
            if BREAK == 2:
                mbarrier.wait(empty.index(st), (c // 2) & 1)   # 2: the fresh barrier's phase 0 never completes
            else:
                mbarrier.wait(empty.index(st), ((c // 2) & 1) ^ 1)
            x_s.index(st).store(gl.load(x + c * N + i) * 2.0)
            gl.thread_barrier()
            mbarrier.arrive(ready.index(st), count=1)

    @gluon.jit
    def _ws_rules_kernel(x, y, n, N: gl.constexpr, BREAK: gl.constexpr):
        """y = 2 x, row by row through a two-stage ring from a producer partition to the default one."""
        x_s = gl.allocate_shared_memory(gl.float32, [2, N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        gl.warp_specialize([(_ws_consumer, (x_s, y, ready, empty, n, N, BREAK)),
                            (_ws_producer, (x, x_s, ready, empty, n, N, BREAK))], [4], [64])


@pytest.mark.parametrize("broken", [0, 1, 2])
def test_emulator_warp_specialisation(broken):
    """The emulator's partitions meet at their mbarriers: correct; a stage read without waiting for it (the default
    partition runs first: uninitialised shared memory, NaN, and its arrivals then run the producer's phases out of
    step: a deadlock); a wait on a phase that never completes (a deadlock)."""
    n, N = 7, 128
    x = torch.randn(n, N)
    y = torch.zeros(n, N)
    if broken == 0:
        E.run_kernel(_ws_rules_kernel, (1,), x, y, n, N=N, BREAK=0, num_warps=4)
        torch.testing.assert_close(y, 2 * x, rtol=0, atol=0)
        return
    with pytest.raises(E.GluonHazard, match="deadlock"):
        E.run_kernel(_ws_rules_kernel, (1,), x, y, n, N=N, BREAK=broken, num_warps=4)
    assert y[0].isnan().all() if broken == 1 else (y == 0).all()
