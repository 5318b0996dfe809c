"""Which training calls take the Gluon kernels of the training pipeline, checked on CPU with the GPU facts patched
in: the factored intra-chunk backward (``launch._bwd_intra_fused_unsupported``: every condition of its domain gives
its own reason, an in-domain call none; on CPU the Triton launches run), the intra-chunk forward
(``launch._train_intra_fused_unsupported``: the same reason for every call; its Triton ``ONLY_FLAGGED`` launch,
which follows the Gluon one on the GPU, run in the interpreter: the flagged (chunk, value head) pairs come out bit
for bit as the full launch writes them, the others untouched) and the state scans (``launch._scan_fused_unsupported``,
``launch.scan_fused_tiles``). The kernels themselves are tested on an sm_90 GPU (tests/gpu/test_kda_bwd_fused_gpu.py,
test_kda_intra_fused_gpu.py, test_kda_scan_gpu.py)."""
import pytest
import torch

from delta_attn.ops import _launch
from delta_attn.ops.kda import launch

CUDA = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(launch, "gluon_available", lambda device: True)
    monkeypatch.setattr(launch, "gluon_version", lambda: launch.KERNELS_TRITON)
    monkeypatch.setattr(launch, "device_capability", lambda device: (9, 0))
    if launch._kda_bwd_intra_fused_kernel is None or launch._kda_train_intra_fused_kernel is None:
        pytest.skip("the installed Triton has no Gluon")


def _args(dtype=torch.bfloat16, K=128, V=128, A_log=None, dt_bias=None, lower_bound=None, allow_tf32=False,
          device=CUDA):
    q = torch.empty(1, 1, 2, K, dtype=dtype)
    v = torch.empty(1, 1, 4, V, dtype=dtype)
    prec = launch.precision(dtype, allow_tf32, K, train=True)
    return q, v, A_log, dt_bias, lower_bound, prec, device


def _call(**case):
    return launch._bwd_intra_fused_unsupported(*_args(**case))


def test_in_domain_call_runs_gluon(hopper):
    assert _call() is None
    assert _call(allow_tf32=True) is None


@pytest.mark.parametrize("case,expect", [
    (dict(dtype=torch.float16), "bfloat16"),
    (dict(dtype=torch.float32), "bfloat16"),
    (dict(K=64), "K and V"),
    (dict(V=256), "K and V"),
    (dict(A_log=torch.zeros(4)), "gate"),
    (dict(dt_bias=torch.zeros(4 * 128)), "gate"),
    (dict(lower_bound=-5.0), "gate"),
])
def test_each_condition_names_itself(hopper, case, expect):
    assert expect in _call(**case)


def test_two_float_decays_are_outside(hopper, monkeypatch):
    """bf16 never sums the log decays in two floats; the condition is checked on its own all the same."""
    assert not launch.precision(torch.bfloat16, False, 128, train=True).two_float
    two = launch.Precision(torch.bfloat16, "tf32", "tf32", "tf32", True, launch.tl.bfloat16)
    monkeypatch.setattr(launch, "precision", lambda *a, **k: two)
    assert "two floats" in _call()


def test_architecture_and_triton_release(hopper, monkeypatch):
    monkeypatch.setattr(launch, "device_capability", lambda device: (10, 0))
    assert "sm_90" in _call()
    monkeypatch.setattr(launch, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(launch, "gluon_version", lambda: (3, 9))
    assert "Gluon API of Triton 3.6" in _call()


def test_cpu_calls_take_the_triton_kernels():
    assert "CUDA" in _call(device=torch.device("cpu"))


def test_meta_tensors_compiled_ahead_stand_for_their_device():
    """Compiled ahead (``_compile_backward``: meta tensors inside ``compile_only``), the dispatch asks about the
    device the launches compile for, so the kernel the real call runs is the one compiled."""
    meta = torch.device("meta")
    assert _launch.compile_device(meta) == meta
    with _launch.compiled_together():
        with _launch.compile_only(CUDA):
            assert _launch.compile_device(meta) == CUDA
            assert _launch.compile_device(torch.device("cpu")) == torch.device("cpu")
    assert _launch.compile_device(meta) == meta


def test_reverse_scan_takes_gluon_for_bf16_at_128_whatever_the_gate(hopper):
    """The Gluon reverse state scan (``kernels_scan_gluon.py``) reads the forward's bf16 intermediates only: bf16
    q, k, v with K = V = 128 is its whole domain (a gate was applied before), on CUDA only."""
    if launch._kda_bwd_scan_fused_kernel is None:
        pytest.skip("the installed Triton has no Gluon")
    q = torch.empty(1, 1, 2, 128, dtype=torch.bfloat16)
    v = torch.empty(1, 1, 4, 128, dtype=torch.bfloat16)
    assert launch._scan_fused_unsupported(q, v, CUDA) is None
    assert "bfloat16" in launch._scan_fused_unsupported(q.half(), v.half(), CUDA)
    assert "K and V" in launch._scan_fused_unsupported(q, torch.empty(1, 1, 4, 64, dtype=torch.bfloat16), CUDA)


def test_cpu_reverse_scans_take_the_triton_kernel():
    q = torch.empty(1, 1, 2, 128, dtype=torch.bfloat16)
    v = torch.empty(1, 1, 4, 128, dtype=torch.bfloat16)
    assert "CUDA" in launch._scan_fused_unsupported(q, v, torch.device("cpu"))


def test_scan_tiles_by_chains(monkeypatch):
    """V blocks of 64 (one warpgroup, two-stage ring) while two programs per chain fit the SMs; else the whole V in
    one program per chain (two warpgroups, the kernels' NW their warps), two stages then one as the fallback."""
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    (blocks,) = launch.scan_fused_tiles(66, CUDA)       # 132 programs: one per SM
    assert blocks.get("BV") == 64 and blocks.num_warps == blocks.get("NW") == 4 and blocks.get("STAGES") == 2
    two, one = launch.scan_fused_tiles(67, CUDA)
    assert two.get("BV") == one.get("BV") == 128 and two.num_warps == two.get("NW") == one.get("NW") == 8
    assert (two.get("STAGES"), one.get("STAGES")) == (2, 1)


def _backward_launches(monkeypatch, gluon: bool, B=2, T=130, H=2, HV=4, K=128, V=128, decay_dtype=torch.float32):
    """(kernel name, EXACT or None, {argument: value}) of every launch ``train_backward`` makes, recorded on meta
    tensors (nothing runs), with the Gluon dispatch decided by ``gluon``."""
    monkeypatch.setattr(launch, "_bwd_intra_fused_unsupported", lambda *a, **kw: None if gluon else "forced")
    monkeypatch.setattr(launch, "_scan_fused_unsupported", lambda *a, **kw: None if gluon else "forced")
    calls = []

    def record(kernel, grid, args, fixed, candidates):
        calls.append((getattr(kernel, "fn", kernel).__name__, fixed.get("EXACT"), dict(zip(kernel.arg_names, args))))

    monkeypatch.setattr(launch, "launch", record)
    meta, bf, f32 = torch.device("meta"), torch.bfloat16, torch.float32
    R, nc, bt = B * T, launch.max_chunks(B, T, B, False), launch.TRAIN_CHUNK
    q, k = (torch.empty(B, T, H, K, dtype=bf, device=meta) for _ in range(2))
    v = torch.empty(B, T, HV, V, dtype=bf, device=meta)
    g = torch.empty(B, T, HV, K, dtype=decay_dtype, device=meta)
    beta = torch.empty(B, T, HV, dtype=decay_dtype, device=meta)
    do = torch.empty(B, T, HV, V, dtype=bf, device=meta)
    saved = launch.Saved(*(torch.empty(*s, dtype=d, device=meta) for s, d in (
        ((R, HV, K), bf), ((R, HV, K), bf), ((R, HV, K), bf), ((R, HV, bt), bf), ((R, HV, bt), f32),
        ((nc, HV, K), f32), ((nc, HV, K, V), bf), ((R, HV, V), bf))))
    assert launch.train_backward(q, k, v, g, beta, None, None, None, None, saved, do, None, K ** -0.5, None, True,
                                 False) is None
    return calls


def test_gluon_domain_launches_no_stage_two(hopper, monkeypatch):
    """In the Gluon domain the backward launches the Gluon reverse scan, the Gluon kernel (which forms the per-chunk
    operand gradients from the saved states, dO and du itself) and the EXACT launch, which reads the stage-2 tensors
    the Gluon kernel wrote for its flagged pairs; elsewhere the Triton scan, then ``_kda_bwd_chunk_grads_kernel``
    before both Triton intra launches."""
    calls = _backward_launches(monkeypatch, gluon=True)
    assert [(n, e) for n, e, _ in calls] == [("_kda_bwd_scan_fused_kernel", None),
                                             ("_kda_bwd_intra_fused_kernel", None), ("_kda_bwd_intra_kernel", True)]
    fused, exact = calls[1][2], calls[2][2]
    for n in ("HS", "DH", "VNEW", "DO"):
        assert fused[n].dtype == torch.bfloat16, n
    for n in ("DQG", "DKD", "DW", "DAQK", "DGC", "FLAGS", "DU", "TM"):
        assert fused[n] is exact[n], n
    calls = _backward_launches(monkeypatch, gluon=False)
    assert [(n, e) for n, e, _ in calls] == [("_kda_bwd_scan_kernel", None), ("_kda_bwd_chunk_grads_kernel", None),
                                             ("_kda_bwd_intra_kernel", False), ("_kda_bwd_intra_kernel", True)]


@pytest.mark.parametrize("decay_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_decays_reach_the_kernels_as_given(hopper, monkeypatch, decay_dtype):
    """A bf16 / fp16 g or beta does not leave the Gluon domain, and no pass casts it: every launch of the backward,
    Gluon (which widens 16-bit values on chip) or Triton, reads g and beta as given."""
    for gluon, first in ((True, 1), (False, 2)):
        calls = _backward_launches(monkeypatch, gluon=gluon, decay_dtype=decay_dtype)
        assert calls[first:], calls
        for name, _, a in calls[first:]:
            assert a["g"].dtype == a["beta"].dtype == decay_dtype, (gluon, name)


INTRA_OUTPUTS = ("W", "U", "QG", "KD", "AQK", "GC", "TM")


def test_intra_forward_has_the_backward_domain(hopper):
    """One validation for both Gluon intra-chunk kernels of the training pipeline: the same reason for every call."""
    for case in (dict(), dict(dtype=torch.float16), dict(K=64),
                 dict(A_log=torch.zeros(4)), dict(device=torch.device("cpu"))):
        assert launch._train_intra_fused_unsupported(*_args(**case)) == _call(**case)


def _intra_launch(monkeypatch, cu, HV=2, K=16, V=16, T=150):
    """The training forward on CPU with K = V = 16 (every pair factored or not, as the inputs say): the recorded
    launches of the intra-chunk kernel, each with copies of its arguments taken right after it ran."""
    runs = []
    real = _launch._run

    def spy(p):
        chosen = real(p)
        if getattr(p.kernel, "fn", p.kernel).__name__ == "_kda_train_intra_kernel":
            runs.append((p, {n: (a.clone() if torch.is_tensor(a) else a) for n, a in zip(p.kernel.arg_names, p.args)}))
        return chosen
    monkeypatch.setattr(_launch, "_run", spy)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, T, 1, K, generator=gen)
    k = torch.randn(1, T, 1, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, K, generator=gen) + 2.0)
    g[0, 45, 1, :4] = -1e4                          # the first chunk of head 1 decays strongly: its safe path
    beta = torch.rand(1, T, HV, generator=gen)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    launch.train_forward(q, k, v, g, beta, None, cu_t, None, None, K ** -0.5, None, True, True, True)
    return runs


def test_only_flagged_launch_redoes_the_flagged_pairs_alone(monkeypatch):
    runs = _intra_launch(monkeypatch, (0, 100, 150))
    assert len(runs) == 1
    p, full = runs[0]
    assert p.fixed["ONLY_FLAGGED"] is False
    NC, HV = full["chunk_info"].shape[0], full["HV"]
    flags = torch.zeros(NC, HV, dtype=torch.int32)
    flags[0, 1] = flags[1, 0] = flags[2, 1] = 1     # the strong decay's pair, a short last chunk, the 2nd sequence
    bufs = {n: torch.full_like(full[n], -7.0) for n in INTRA_OUTPUTS}
    args = tuple(flags if n == "FLAGS" else bufs.get(n, full[n]) for n in p.kernel.arg_names[:len(p.args)])
    _launch.launch(p.kernel, p.grid, args, dict(p.fixed, ONLY_FLAGGED=True), p.candidates)
    for c, (_, row0, L) in enumerate(full["chunk_info"].tolist()):
        for hv in range(HV):
            for n in INTRA_OUTPUTS:
                if n == "GC":
                    got, want = bufs[n][c, hv], full[n][c, hv]
                else:
                    got = bufs[n].view(-1, HV, bufs[n].shape[-1])[row0:row0 + L, hv]
                    want = full[n].view(-1, HV, full[n].shape[-1])[row0:row0 + L, hv]
                if flags[c, hv]:
                    assert torch.equal(got, want), (n, c, hv)
                else:
                    assert bool((got == -7.0).all()), (n, c, hv)


@pytest.mark.parametrize("g_dtype,T,domain,strided,expect", [
    (torch.float32, 5, True, False, True), (torch.bfloat16, 5, True, False, True),
    (torch.float16, 5, True, False, True), (torch.float64, 5, True, False, False),
    (torch.float32, 5, True, True, False), (torch.float32, 0, True, False, False),
    (torch.float32, 5, False, False, False)])
def test_the_intra_forward_reports_g_maximum_where_it_reads_g_as_given(g_dtype, T, domain, strided, expect,
                                                                         monkeypatch):
    """``launch.train_reports_decay``: the Gluon intra-chunk forward writes g's maximum for the check where it runs
    and reads g with no cast (a float64 g is cast to float32 first, which could round a tiny positive entry to 0) and
    no copy (a strided g is copied first, and the check looks for the tensor it was given)."""
    monkeypatch.setattr(launch, "_train_intra_fused_unsupported", lambda *a: None if domain else "outside")
    q = torch.empty(1, T, 2, 128, dtype=torch.bfloat16)
    v = torch.empty(1, T, 2, 128, dtype=torch.bfloat16)
    g = torch.empty(1, T, 2, 256 if strided else 128, dtype=g_dtype)[..., :128]
    assert launch.train_reports_decay(q, v, g, None, None, None, False) is expect
