"""Which training backwards take the Gluon factored intra-chunk kernel (``launch._bwd_intra_fused_unsupported``),
checked on CPU with the GPU facts patched in: every condition of its domain gives its own reason, and an in-domain
call none; on CPU the Triton launches run. The kernel itself is tested on an sm_90 GPU
(tests/gpu/test_kda_bwd_fused_gpu.py)."""
import pytest
import torch

from delta_attn.ops.kda import launch

CUDA = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(launch, "gluon_available", lambda device: True)
    monkeypatch.setattr(launch, "gluon_version", lambda: launch.FUSED_TRITON)
    monkeypatch.setattr(launch, "device_capability", lambda device: (9, 0))
    if launch._kda_bwd_intra_fused_kernel is None:
        pytest.skip("the installed Triton has no Gluon")


def _call(dtype=torch.bfloat16, K=128, V=128, g_dtype=torch.float32, beta_dtype=torch.float32, A_log=None,
          dt_bias=None, lower_bound=None, allow_tf32=False, device=CUDA):
    q = torch.empty(1, 1, 2, K, dtype=dtype)
    v = torch.empty(1, 1, 4, V, dtype=dtype)
    g = torch.empty(1, 1, 4, K, dtype=g_dtype)
    beta = torch.empty(1, 1, 4, dtype=beta_dtype)
    prec = launch.precision(dtype, allow_tf32, K, train=True)
    return launch._bwd_intra_fused_unsupported(q, v, g, beta, A_log, dt_bias, lower_bound, prec, device)


def test_in_domain_call_runs_gluon(hopper):
    assert _call() is None
    assert _call(allow_tf32=True) is None


@pytest.mark.parametrize("case,expect", [
    (dict(dtype=torch.float16), "bfloat16"),
    (dict(dtype=torch.float32), "bfloat16"),
    (dict(K=64), "K and V"),
    (dict(V=256), "K and V"),
    (dict(g_dtype=torch.bfloat16), "g or beta is not float32"),
    (dict(beta_dtype=torch.bfloat16), "g or beta is not float32"),
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
    from delta_attn.ops import _launch
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


def test_reverse_scan_ring_depth_by_grid(monkeypatch):
    """Two operand stages when each program is alone on its SM (V blocks of 64: 2 per chain), one when two share."""
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    (one,) = launch.scan_fused_tiles(16, CUDA)          # 1 x 32768, 16 heads: 32 programs
    assert one.get("BV") == 64 and one.get("STAGES") == 2
    (many,) = launch.scan_fused_tiles(128, CUDA)        # 8 x 4096, 16 heads: 256 programs
    assert many.get("STAGES") == 1


def _backward_launches(monkeypatch, gluon: bool, B=2, T=130, H=2, HV=4, K=128, V=128):
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
    g = torch.empty(B, T, HV, K, dtype=f32, device=meta)
    beta = torch.empty(B, T, HV, dtype=f32, device=meta)
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
