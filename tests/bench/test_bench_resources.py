"""Issue 20, on CPU: the per-kernel resource report's metadata parsing (stand-ins shaped like Triton 3.6's
CompiledKernel, and a real kernel compiled for sm_90 in a subprocess), the occupancy arithmetic against
hand-computed cases, the roofline, the launch-capture plumbing (a fake Triton API, and install /
restore on the real one), the runner's rows, the report section and the plot (modules: bench/launch_capture.py,
occupancy.py, roofline.py, resources.py; report.py's resource section, plots.py's roofline plot)."""
import json
import os
import subprocess
import sys
import textwrap
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from delta_attn import cli
from delta_attn.bench import (cases, impls, launch_capture, occupancy, plots, report, resources, results_files,
                              roofline)
from delta_attn.bench.impls import Bound, Impl
from delta_attn.bench.runner import Runner, Settings, Task

SM90 = occupancy.device_limits(props=SimpleNamespace(major=9, minor=0))   # the table alone

# ------------------------------------------------------------------------------------------ stand-ins

# the fields of Triton 3.6's KernelMetadata that matter here (the real one has ~35, read from the JSON)
KernelMetadata = namedtuple("KernelMetadata", ["name", "num_warps", "num_stages", "num_ctas", "shared", "maxnreg",
                                               "target", "warp_size", "arch", "tmem_size"])
GPUTarget = namedtuple("GPUTarget", ["backend", "arch", "warp_size"])


def fake_compiled(name="_kda_fwd_kernel", num_warps=4, num_stages=2, shared=98304, regs=168, spills=0,
                  constants=None, arg_names=("q", "k", "n", "BT", "BK", "USE_G"), constexpr=(3, 4, 5)):
    """Shaped like triton.compiler.compiler.CompiledKernel after _init_handles (3.6): metadata
    namedtuple, n_regs / n_spills from the driver, src = ASTSource (constants keyed by (index,))."""
    params = [SimpleNamespace(is_constexpr=i in constexpr) for i in range(len(arg_names))]
    fn = SimpleNamespace(arg_names=list(arg_names), params=params)
    consts = {(3,): 64, (4,): 128, (5,): True} if constants is None else constants
    md = KernelMetadata(name=name, num_warps=num_warps, num_stages=num_stages, num_ctas=1, shared=shared,
                        maxnreg=None, target=GPUTarget("cuda", 90, 32), warp_size=32, arch="sm90", tmem_size=0)
    return SimpleNamespace(name=name, metadata=md, n_regs=regs, n_spills=spills, src=SimpleNamespace(constants=consts,
                                                                                                      fn=fn))


class FakeLazyDict:
    def __init__(self, data):
        self.data = data


class FakeChain:
    """triton.knobs.HookChain's interface."""

    def __init__(self):
        self.calls = []

    def add(self, f):
        if f not in self.calls:
            self.calls.append(f)

    def remove(self, f):
        if f in self.calls:
            self.calls.remove(f)

    def __call__(self, md):
        for f in self.calls:
            f(md)


class FakeCompiledKernel:
    """A class standing for CompiledKernel: launch_metadata(grid, stream, *args) -> LazyDict."""

    def __init__(self, compiled):
        self.__dict__.update(compiled.__dict__)

    def launch_metadata(self, grid, stream, *args):
        return FakeLazyDict({"name": self.name, "function": 1234, "stream": stream})


class FakeAutotuner:
    def __init__(self, ck, grid):
        self.ck, self.grid = ck, grid

    def _bench(self, *args, config=None, **meta):
        for _ in range(5):
            launch(self.ck, self.grid)
        return 1.0


CHAIN = FakeChain()
API = (launch_capture._HookChainRegistry(CHAIN), FakeCompiledKernel, FakeAutotuner, "fake")


def launch(ck, grid):
    """What Triton's JITFunction.run + the C launcher do: launch_metadata, then the enter hook."""
    md = ck.launch_metadata(grid, 0)
    CHAIN(md)


# ------------------------------------------------------------------------------------------ parsing

def test_parse_launch_reads_the_compiled_kernel():
    k = launch_capture.parse_launch(fake_compiled(), (32, 16), phase="bwd")
    assert k["kernel"] == "_kda_fwd_kernel" and k["phase"] == "bwd" and k["source"] == "triton"
    assert k["config"] == {"constexprs": {"BT": 64, "BK": 128, "USE_G": True}, "num_warps": 4, "num_stages": 2,
                           "num_ctas": 1, "maxnreg": None}
    assert (k["regs"], k["spills"], k["shared"]) == (168, 0, 98304)
    assert k["grid"] == [32, 16, 1] and k["programs"] == 512 and k["arch"] == 90
    json.dumps(k)
    # a non-constexpr argument that Triton specialised (a None pointer) is not a tile size
    c = fake_compiled(constants={(1,): None, (3,): 32})
    assert launch_capture.parse_launch(c, (1,))["config"]["constexprs"] == {"BT": 32}
    # the metadata as a plain dict (a kernel's JSON) parses the same; a tl.dtype becomes its string
    md = dict(fake_compiled().metadata._asdict(), target={"backend": "cuda", "arch": 90, "warp_size": 32})
    assert launch_capture.parse_metadata(md)["shared"] == 98304 and launch_capture.parse_metadata(md)["arch"] == 90
    class Dtype:
        def __str__(self):
            return "bf16"
    assert launch_capture._plain(Dtype()) == "bf16" and launch_capture._plain((1, (2, None))) == [1, [2, None]]
    # a launch the hook saw without its compiled kernel keeps its name only
    assert launch_capture.parse_launch(None, None, name="k")["regs"] is None


def test_group_launches_merges_repeats_in_order():
    a = launch_capture.parse_launch(fake_compiled(name="a"), (4,))
    b = launch_capture.parse_launch(fake_compiled(name="b"), (4,))
    a2 = launch_capture.parse_launch(fake_compiled(name="a"), (8,))
    g = launch_capture.group_launches([a, b, dict(a), a2, dict(b)])
    assert [(k["kernel"], k["grid"][0], k["launches"]) for k in g] == [("a", 4, 2), ("b", 4, 2), ("a", 8, 1)]


REAL_KERNEL = textwrap.dedent('''
    import json, sys
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from delta_attn.bench import launch_capture

    @triton.jit
    def mm(a_ptr, b_ptr, c_ptr, n, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, n, BK):
            a = tl.load(a_ptr + rm[:, None] * n + (k + rk)[None, :])
            b = tl.load(b_ptr + (k + rk)[:, None] * BN + rn[None, :])
            acc += tl.dot(a, b)
        tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)

    sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "n": "i32", "BM": "constexpr", "BN": "constexpr",
           "BK": "constexpr"}
    src = ASTSource(fn=mm, signature=sig, constexprs={"BM": 64, "BN": 64, "BK": 32})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    parsed = launch_capture.parse_launch(ck, (7,))
    # the launch path of JITFunction.run and the C launcher, minus the GPU: the binary "loads" (what
    # _init_handles sets from the driver), launch_metadata builds the LazyDict, the enter hook gets it
    ck._init_handles = lambda: None
    ck.function, ck.n_regs, ck.n_spills = 0, 96, 2
    import torch
    with launch_capture.TritonLaunchCapture(torch.device("cuda")) as cap:
        assert cap.reason is None, cap.reason
        md = ck.launch_metadata((7, 2), 0)
        triton.knobs.runtime.launch_enter_hook(md)
    print(json.dumps({"version": triton.__version__, "launch": parsed, "hooked": cap.launches()}))
''')


def test_parse_launch_on_a_real_kernel_compiled_for_sm90(tmp_path):
    """Compile-only (no GPU): the metadata of the installed Triton's CompiledKernel parses; registers
    and spills come from the driver at load time, so they are absent here."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = tmp_path / "compile_mm.py"              # @triton.jit needs its source in a file
    script.write_text(REAL_KERNEL)
    try:
        p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.skip("compiling for sm_90 took too long here")
    if p.returncode != 0:
        pytest.skip(f"this Triton cannot compile for sm_90 here: {p.stderr.strip().splitlines()[-1:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    k = out["launch"]
    assert k["kernel"] == "mm" and k["config"]["constexprs"] == {"BM": 64, "BN": 64, "BK": 32}
    assert k["config"]["num_warps"] == 4 and k["config"]["num_stages"] == 3 and k["arch"] == 90
    assert k["shared"] > 0 and k["grid"] == [7, 1, 1] and k["regs"] is None
    [h] = out["hooked"]
    assert h["kernel"] == "mm" and (h["regs"], h["spills"], h["grid"]) == (96, 2, [7, 2, 1])
    assert h["config"] == k["config"] and h["shared"] == k["shared"]


# ------------------------------------------------------------------------------------------ occupancy

def test_device_limits_from_properties_and_table():
    props = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                            regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                            shared_memory_per_multiprocessor=233472, shared_memory_per_block_optin=232448,
                            warp_size=32)
    lim = occupancy.device_limits(props=props)
    assert lim["sm_count"] == 132 and lim["max_blocks_per_sm"] == 32 and lim["smem_reserved_per_block"] == 1024
    assert "torch.cuda.get_device_properties" in lim["source"] and "sm_90" in lim["source"]
    # a partial properties object: what it has wins, the table fills in the rest
    lim = occupancy.device_limits(props=SimpleNamespace(major=8, minor=0, multi_processor_count=100))
    assert lim["sm_count"] == 100 and lim["smem_per_sm"] == 167936 and lim["max_blocks_per_sm"] == 32
    assert occupancy.device_limits(props=None)["sm_count"] == 132           # no device: the sm_90 table
    assert SM90["smem_per_sm"] == 228 * 1024 and SM90["smem_per_block_optin"] == 227 * 1024


@pytest.mark.parametrize("warps, regs, shared, want, binding, by", [
    # 128 threads x 255 registers: 255*32 = 8160 -> 8192 per warp; 16384 per sub-partition / 8192 = 2 warps,
    # x 4 = 8 warps per SM = 2 blocks of 4 warps
    (4, 255, 0, 2, "registers", {"registers": 2, "shared memory": 233472 // 1024, "threads": 16, "blocks": 32}),
    # 256 threads x 96 registers: 3072 per warp, floor(16384 / 3072) = 5 -> 20 warps -> 2 blocks of 8;
    # 100 KiB + 1 KiB reserved = 103424 B, floor(233472 / 103424) = 2: both bind
    (8, 96, 100 * 1024, 2, "registers+shared memory", {"registers": 2, "shared memory": 2, "threads": 8, "blocks": 32}),
    # shared memory: 80 KiB + 1 KiB = 82944 B -> floor(233472 / 82944) = 2; registers allow 8
    (4, 64, 80 * 1024, 2, "shared memory", {"registers": 8, "shared memory": 2, "threads": 16, "blocks": 32}),
    # block count: one warp of 32 registers fits 64 times by registers and threads; 32 blocks per SM at most
    (1, 32, 0, 32, "blocks", {"registers": 64, "shared memory": 228, "threads": 64, "blocks": 32}),
    # threads: 16 warps -> 64 / 16 = 4 blocks; registers 24*32 = 768 per warp -> 21 warps per sub-partition -> 5
    (16, 24, 0, 4, "threads", {"registers": 5, "shared memory": 228, "threads": 4, "blocks": 32}),
    # the sub-partitions matter: 2 warps x 200 registers = 6400 per warp; floor(16384 / 6400) = 2 per
    # sub-partition -> 8 warps -> 4 blocks (the whole file would say floor(65536 / 6400) = 10 warps -> 5)
    (2, 200, 0, 4, "registers", {"registers": 4, "shared memory": 228, "threads": 32, "blocks": 32}),
    # 128 B granularity: 1000 B + 1024 -> 2048 B per block; 114 by shared memory; 24 regs -> 768 per warp -> 21 blocks
    (4, 24, 1000, 16, "threads", {"registers": 21, "shared memory": 114, "threads": 16, "blocks": 32}),
])
def test_occupancy_hand_computed(warps, regs, shared, want, binding, by):
    o = occupancy.occupancy(warps, regs, shared, SM90, programs=1056)
    assert o["programs_per_sm"] == want and o["binding"] == binding and o["by"] == by
    assert o["warps_per_sm"] == want * warps and o["occupancy"] == pytest.approx(want * warps / 64)
    assert o["waves"] == pytest.approx(1056 / (132 * want))


def test_occupancy_limits_that_forbid_a_launch_and_unknowns():
    o = occupancy.occupancy(4, 32, 228 * 1024, SM90, programs=10)     # past 227 KiB per block
    assert o["programs_per_sm"] == 0 and o["binding"] == "shared memory" and o["waves"] is None
    assert occupancy.occupancy(4, 32, 227 * 1024, SM90)["programs_per_sm"] == 1      # exactly the opt-in limit fits
    assert occupancy.occupancy(32, 255, 0, SM90)["by"]["registers"] == 0             # 32 warps x 8192 > 64K per block
    assert occupancy.occupancy(4, 256, 0, SM90)["by"]["registers"] == 0              # > 255 per thread
    o = occupancy.occupancy(4, None, 0, SM90)                                        # registers unknown: left out
    assert o["unknown"] == ["registers"] and o["by"]["registers"] is None and o["binding"] == "threads"
    assert occupancy.occupancy(4, 0, 0, SM90)["by"]["registers"] is None             # no registers: no limit
    # clusters: 2 CTAs per program halve the programs per SM and double the CTAs of the waves
    o = occupancy.occupancy(4, 255, 0, SM90, programs=132, num_ctas=2)
    assert o["programs_per_sm"] == 1 and o["waves"] == pytest.approx(264 / (132 * 2))


# ------------------------------------------------------------------------------------------ roofline

CEIL = {"copy_gbps": 4000.0, "gemm_tflops": 800.0}


def test_roofline_compute_and_memory_sides():
    r = roofline.roofline(1e12, 1e9, 10.0, CEIL)            # 100 TFLOP/s, 100 GB/s, 1000 FLOP/B
    assert r["ridge_flop_per_byte"] == pytest.approx(200)
    assert r["ai_flop_per_byte"] == pytest.approx(1000) and r["bound"] == "compute"
    assert r["achieved_tflops"] == pytest.approx(100) and r["attainable_tflops"] == pytest.approx(800)
    assert r["fraction"] == pytest.approx(0.125) and r["achieved_gbps"] == pytest.approx(100)
    r = roofline.roofline(1e11, 1e10, 5.0, CEIL)            # 10 FLOP/B: memory side, 2000 of 4000 GB/s
    assert r["bound"] == "memory" and r["attainable_tflops"] == pytest.approx(40)
    assert r["fraction"] == pytest.approx(0.5) and r["achieved_gbps"] == pytest.approx(2000)
    assert roofline.roofline(2e11, 1e9, 1.0, CEIL)["bound"] == "compute"            # exactly at the ridge
    r = roofline.roofline(None, 1e10, 5.0, CEIL)            # no FLOPs: the bandwidth side only
    assert r["ai_flop_per_byte"] is None and r["fraction"] == pytest.approx(0.5)
    assert roofline.roofline(1e9, 1e9, 1.0, {}) is None


def test_linear_flop_lower_bound_and_row_roofline():
    case = dict(op="kda", B=8, S=4096, H=16, D=128)
    assert roofline.linear_flops(case, "fwd") == (7 * 128 ** 2 + 2 * 128) * 8 * 4096 * 16
    assert roofline.linear_flops(case, "fwd+bwd") == 3 * roofline.linear_flops(case, "fwd")
    assert roofline.linear_flops(dict(op="diag_decode", B=64, H=16, D=128), "fwd") == 4 * 128 * 64 * 16
    assert roofline.linear_flops(dict(op="flash", B=1, S=8, H=2, D=8), "fwd") is None
    row = {"status": "ok", "op": "kda", "case": {k: v for k, v in case.items() if k != "op"}, "direction": "fwd",
           "flops": None, "bytes": 1e9, "ms": 1.0}
    rl = roofline.row_roofline(row, CEIL)
    assert rl["flops_model"] == "recurrence (lower bound)" and rl["bound"] == "memory"
    assert rl["fraction"] == pytest.approx(1e9 / 1e-3 / 1e9 / 4000)          # = fraction of the copy bandwidth
    row.update(op="flash", flops=1e12)
    assert roofline.row_roofline(row, CEIL)["flops_model"] == "flash-attn"
    assert roofline.row_roofline(dict(row, status="FAILED"), CEIL) is None


# ------------------------------------------------------------------------------------------ capture

def test_capture_under_the_interpreter_or_on_cpu_gives_the_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with launch_capture.TritonLaunchCapture(torch.device("cpu")) as cap:
        pass
    assert "interpreter" in cap.reason and "compiles nothing" in cap.reason and cap.launches() == []
    with launch_capture.TritonLaunchCapture(torch.device("cuda")) as cap:     # a GPU run with the interpreter forced on
        pass
    assert cap.reason == launch_capture.INTERPRETER_REASON
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with launch_capture.TritonLaunchCapture(torch.device("cpu")) as cap:
        pass
    assert cap.reason == "CPU run: no compiled kernels"


def test_capture_plumbing_with_a_fake_triton():
    ck_a = FakeCompiledKernel(fake_compiled(name="a"))
    ck_b = FakeCompiledKernel(fake_compiled(name="b", num_warps=8, shared=0, regs=40))
    original = FakeCompiledKernel.__dict__["launch_metadata"]
    launch(ck_a, (3,))                                            # before: not recorded
    with launch_capture.TritonLaunchCapture(torch.device("cuda"), api=API) as cap:
        assert cap.reason is None and len(CHAIN.calls) == 1
        assert FakeCompiledKernel.__dict__["launch_metadata"] is not original
        launch(ck_a, (3,))
        FakeAutotuner(ck_b, (9,))._bench(config=None)            # 5 benchmarking launches: counted, not listed
        launch(ck_a, (3,))
        cap.mark("bwd")
        launch(ck_b, (2, 2))
        with launch_capture.TritonLaunchCapture(torch.device("cuda"), api=API) as inner:   # one capture at a time
            assert inner.reason == "another launch capture is active"
        cap.stop()
        launch(ck_b, (2, 2))                                      # after stop: not recorded
    assert CHAIN.calls == [] and FakeCompiledKernel.__dict__["launch_metadata"] is original
    assert cap.autotune_launches == 5
    ks = launch_capture.group_launches(cap.launches())
    assert [(k["kernel"], k["phase"], k["grid"], k["launches"]) for k in ks] == [
        ("a", "fwd", [3, 1, 1], 2), ("b", "bwd", [2, 2, 1], 1)]
    assert ks[1]["config"]["num_warps"] == 8 and ks[1]["regs"] == 40


def test_capture_restores_the_patched_methods_after_an_error():
    original = FakeCompiledKernel.__dict__["launch_metadata"]
    with pytest.raises(RuntimeError):
        with launch_capture.TritonLaunchCapture(torch.device("cuda"), api=API):
            raise RuntimeError("boom")
    assert CHAIN.calls == [] and FakeCompiledKernel.__dict__["launch_metadata"] is original
    assert launch_capture._ACTIVE[0] is None


def test_the_installed_triton_has_the_hook_and_the_capture_restores_it(monkeypatch):
    pytest.importorskip("triton")
    api = launch_capture._triton_api()
    if isinstance(api, str):
        pytest.skip(api)
    registry, ck_cls, tuner, version = api
    assert hasattr(ck_cls, "launch_metadata")
    if not isinstance(registry, launch_capture._HookChainRegistry):
        pytest.skip(f"Triton {version} has the older single-callable hook")
    import triton
    chain = triton.knobs.runtime.launch_enter_hook
    before_md, before_calls = ck_cls.__dict__["launch_metadata"], list(chain.calls)
    before_bench = tuner.__dict__.get("_bench") if tuner is not None else None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with launch_capture.TritonLaunchCapture(torch.device("cuda")) as cap:       # installs on the real classes, launches nothing
        assert cap.reason is None and cap._hook in chain.calls
        assert ck_cls.__dict__["launch_metadata"] is not before_md
    assert ck_cls.__dict__["launch_metadata"] is before_md and chain.calls == before_calls
    if tuner is not None:
        assert tuner.__dict__.get("_bench") is before_bench


def test_profiler_events_are_summed_per_kernel():
    ks = launch_capture.summarize_device_events([("flash_fwd", 10.0), ("Memset (Device)", 1.0), ("flash_fwd", 5.0)])
    assert ks[0] == {"source": "profiler", "kernel": "flash_fwd", "launches": 2, "device_us": 15.0}
    assert ks[1]["kernel"] == "Memset (Device)"


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_first_call_joins_profiler_times_and_keeps_peers_kernels():
    fc = launch_capture.FirstCall("full", torch.device("cuda"), api=API)
    ck = FakeCompiledKernel(fake_compiled(name="_attn_fwd"))
    with fc:
        launch(ck, (128, 16))
        fc.stop()
    fc.profiled = {"fwd": SimpleNamespace(reason=None, kernels=launch_capture.summarize_device_events(
        [("_attn_fwd", 40.0), ("void at::native::elementwise_kernel<...>", 2.0)]))}
    kernels, note, meta = fc.result("fwd", lambda: SM90)
    assert [k["kernel"] for k in kernels] == ["_attn_fwd", "void at::native::elementwise_kernel<...>"]
    assert kernels[0]["device_us"] == 40.0 and kernels[0]["occupancy"]["programs_per_sm"] == 2
    assert kernels[1]["source"] == "profiler" and "regs" not in kernels[1]
    assert meta["profiler"] and meta["limits"]["sm_count"] == 132 and note == ""


# ------------------------------------------------------------------------------------------ runner rows

class _Launching(torch.autograd.Function):
    """Identity whose forward and backward 'launch' one fake Triton kernel each."""

    @staticmethod
    def forward(ctx, x):
        launch(FWD_K, (4, 2))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        launch(BWD_K, (8,))
        return g.clone()


FWD_K = FakeCompiledKernel(fake_compiled(name="fwd_k", num_warps=4, regs=128, shared=64 * 1024))
BWD_K = FakeCompiledKernel(fake_compiled(name="bwd_k", num_warps=8, regs=255, shared=0))


def _launching_impl():
    def bind(case, t):
        leaves = [impls._leaf(t[n]) for n in ("q", "k", "v", "g")]
        spec = cases.spec("diag", case, t)

        def fn():
            return _Launching.apply(spec(leaves, False))
        return Bound(fn=fn, leaves=leaves, spec=spec, inputs=leaves)
    return Impl("launcher", "diag", "linear", "delta-attn", bind, lambda c, d, t, g: None)


def _settings(**kw):
    return Settings(device="cpu", tiny=True, dtypes=("fp32",), warmup_ms=0, rep_ms=0, min_reps=2, max_reps=2, **kw)


def test_runner_rows_carry_the_first_calls_kernels_by_direction():
    runner = Runner(_settings(resources="triton"), dict(CEIL))
    runner._res.api = API                      # the fake Triton: launches are "seen" on CPU
    case = dict(op="diag", B=1, S=9, H=2, D=4)
    rows = {r.direction: r for r in runner.run([Task("kernels", case, _launching_impl(), ("fwd", "bwd", "fwd+bwd"),
                                                        torch.float32)], "test")}
    assert all(r.status == "ok" for r in rows.values()), [r.note for r in rows.values()]
    names = {d: [(k["kernel"], k["phase"], k["launches"]) for k in r.kernels] for d, r in rows.items()}
    # one launch each: only the untimed first call is watched (not the gate, the estimate or the timed calls)
    assert names == {"fwd": [("fwd_k", "fwd", 1)], "bwd": [("bwd_k", "bwd", 1)],
                     "fwd+bwd": [("fwd_k", "fwd", 1), ("bwd_k", "bwd", 1)]}
    k = rows["fwd"].kernels[0]
    # 4 warps x 128 regs: 4096 per warp -> 4 per sub-partition -> 16 warps -> 4 blocks; 64 KiB + 1 KiB -> 3 blocks
    assert k["occupancy"]["programs_per_sm"] == 3 and k["occupancy"]["binding"] == "shared memory"
    assert k["programs"] == 8 and k["config"]["constexprs"] == {"BT": 64, "BK": 128, "USE_G": True}
    assert rows["fwd"].resources["limits"]["sm_count"] > 0 and rows["fwd"].kernels_note == ""
    for r in rows.values():
        assert r.roofline["flops_model"] == "recurrence (lower bound)"
        json.loads(results_files.row_json(r.to_json()))     # JSON-serialisable
    assert CHAIN.calls == [] and launch_capture._ACTIVE[0] is None


def test_cpu_rows_say_why_there_are_no_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runner = Runner(_settings(), dict(CEIL))                    # auto: on for the kernels suite
    case = dict(op="diag", B=1, S=9, H=2, D=4)
    rows = runner.run([Task("kernels", case, _launching_impl(), ("fwd",), torch.float32),
                       Task("crossover", case, _launching_impl(), ("fwd",), torch.float32)], "test")
    assert rows[0].kernels is None and "interpreter" in rows[0].kernels_note
    assert rows[1].kernels is None and rows[1].kernels_note == resources.NOT_COLLECTED
    recorded = [r.to_json() for r in rows]
    md = report.resources_section(recorded, {"suite": "kernels", "ceilings": CEIL, "env": {"triton_interpreter": True}})
    assert "## Kernel resources and roofline" in md and "compiles nothing" in md and "### Roofline" in md
    assert report.resources_section(recorded, {"suite": "crossover"}) == ""       # nothing collected, not the kernels suite
    off = Runner(_settings(resources="off"), dict(CEIL)).run([Task("kernels", case, _launching_impl(), ("fwd",),
                                                                   torch.float32)], "test")
    assert off[0].kernels is None and off[0].kernels_note == resources.NOT_COLLECTED


def test_cli_resources_flags():
    p = cli.build_parser()
    assert p.parse_args(["bench", "kernels"]).resources == "auto"
    assert p.parse_args(["bench", "kernels", "--resources"]).resources == "full"
    assert p.parse_args(["bench", "crossover", "--no-resources"]).resources == "off"
    with pytest.raises(ValueError):
        resources.RowResources(SimpleNamespace(resources="sometimes"), {}, torch.device("cpu"))


# ------------------------------------------------------------------------------------------ report

def _row(impl, op, label, direction, kernels=None, provider="delta-attn", **kw):
    r = {"record": "row", "suite": "kernels", "op": op, "impl": impl, "provider": provider, "family": "linear",
         "direction": direction, "dtype": "bf16", "label": label, "case": {}, "tokens": 1, "status": "ok", "note": "",
         "elapsed_s": 1.0, "ms": 1.0, "ms_mean": 1.0, "ms_std": 0.0, "ms_p20": 1.0, "ms_p80": 1.0, "ms_min": 1.0,
         "reps": 3, "first_call_ms": 5.0, "flops": None, "tflops": None, "frac_gemm": None, "bytes": 1e9,
         "gbps": 1000.0, "frac_copy": 0.25, "tokens_per_s": 1e6, "peak_mem_mb": None, "graph_ms": None,
         "graph_note": "", "gate": None, "kernels": kernels, "kernels_note": "", "resources": None}
    r.update(kw)
    return r


def test_section_and_plot(tmp_path):
    ks = occupancy.add_occupancy(launch_capture.group_launches([launch_capture.parse_launch(fake_compiled(), (264,))]), SM90)
    ks[0]["device_us"] = 812.5
    rows = [
        _row("delta-attn triton", "kda", "B=8 S=4096 H=16 D=128", "fwd", ks,
             case={"B": 8, "S": 4096, "H": 16, "D": 128}, resources={"limits": SM90}),
        _row("cuDNN (SDPA)", "flash", "B=8 S=4096 H=16 D=128 causal", "fwd",
             [{"source": "profiler", "kernel": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "launches": 1,
               "device_us": 300.0, "phase": "fwd"}], provider="torch", family="quadratic", flops=2.2e12,
             case={"B": 8, "S": 4096, "H": 16, "D": 128}),
        _row("FA2 (SDPA flash)", "flash", "B=8 S=4096 H=16 D=128 causal", "fwd", [], provider="torch",
             kernels_note="no Triton kernel was launched", flops=2.2e12),
    ]
    run = {"suite": "kernels", "ceilings": CEIL, "env": {"gpu": {"name": "NVIDIA H200"}}}
    md = report.resources_section(rows, run)
    for text in ("## Kernel resources and roofline", "sm_90 table", "`_kda_fwd_kernel`", "BT=64 BK=128 USE_G=True "
                 "warps=4 stages=2", "96.0 KiB", "264 (2.00× SMs)", "812",
                 "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "no Triton kernel was launched (1 rows: FA2",
                 "### Roofline", "recurrence (lower bound)", "flash-attn", "compute", "ridge point 200 FLOP/byte"):
        assert text in md, text
    # 168 regs x 4 warps: 5376 per warp -> 3 per sub-partition -> 12 warps -> 3 blocks; 96 KiB + 1 -> 2 blocks
    assert "| 2 | shared memory |" in md
    # the plot: one point per operator at the headline shape
    assert [r["impl"] for r in roofline.headline_rows(rows)] == ["delta-attn triton", "cuDNN (SDPA)", "FA2 (SDPA flash)"]
    path = plots.roofline_plot(str(tmp_path), run, rows)
    assert path and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert plots.roofline_plot(str(tmp_path), {"suite": "kernels"}, rows) is None     # no ceilings, no plot
    # report.md of a results folder gets the section and the plot
    results_files.write_jsonl(str(tmp_path / "results.jsonl"), dict(run, command="x"), rows)
    text = open(report.render(str(tmp_path))).read()
    assert "## Kernel resources and roofline" in text and "![roofline.png](roofline.png)" in text
