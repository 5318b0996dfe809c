"""Which inference calls the fused Gluon KDA forward takes (``launch.fused_forward_unsupported``), checked on CPU
with the GPU facts patched in: every condition of its domain gives its own reason, and an in-domain call none. The
kernel itself is tested on an sm_90 GPU (tests/gpu/test_kda_fused_gpu.py)."""
import pytest
import torch

from delta_attn.ops.kda import launch


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(launch, "gluon_available", lambda device: True)
    monkeypatch.setattr(launch, "gluon_version", lambda: launch.KERNELS_TRITON)
    monkeypatch.setattr(launch, "device_capability", lambda device: (9, 0))
    if launch._kda_fused_fwd_kernel is None:
        pytest.skip("the installed Triton has no Gluon")


def _qv(dtype=torch.bfloat16, K=128, V=128, HV=16):
    return torch.empty(1, 1, 16, K, dtype=dtype), torch.empty(1, 1, HV, V, dtype=dtype)


def test_in_domain_call_runs_fused(hopper):
    q, v = _qv()
    assert launch.fused_forward_unsupported(q, v, None, num_seqs=4) is None
    assert launch.fused_forward_unsupported(q, v, None, num_seqs=launch.FUSED_MIN_PROGRAMS // 16) is None


@pytest.mark.parametrize("case,expect", [
    (dict(dtype=torch.float16), "bfloat16"),
    (dict(dtype=torch.float32), "bfloat16"),
    (dict(K=64), "K and V"),
    (dict(V=256), "K and V"),
])
def test_each_condition_names_itself(hopper, case, expect):
    q, v = _qv(**case)
    assert expect in launch.fused_forward_unsupported(q, v, None, num_seqs=8)


def test_gate_parameters_and_program_count(hopper):
    q, v = _qv()
    assert "gate" in launch.fused_forward_unsupported(q, v, torch.zeros(16), num_seqs=8)
    why = launch.fused_forward_unsupported(q, v, None, num_seqs=1)
    assert "16 (sequence, value head) pairs" in why and str(launch.FUSED_MIN_PROGRAMS) in why


def test_architecture_and_triton_release(hopper, monkeypatch):
    q, v = _qv()
    monkeypatch.setattr(launch, "device_capability", lambda device: (10, 0))
    assert "sm_90" in launch.fused_forward_unsupported(q, v, None, num_seqs=8)
    monkeypatch.setattr(launch, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(launch, "gluon_version", lambda: (3, 9))
    assert "Gluon API of Triton 3.6" in launch.fused_forward_unsupported(q, v, None, num_seqs=8)


def test_cpu_calls_take_the_split_kernels():
    q, v = _qv()
    assert "CUDA" in launch.fused_forward_unsupported(q, v, None, num_seqs=8)


@pytest.mark.parametrize("pairs", [1, 66, 67, 132, 133, 1024])
def test_form_by_program_count(hopper, monkeypatch, pairs):
    """The warp-specialised form (one program per SM, launched at WS_MAXNREG registers per thread) where the
    (sequence, value head) programs fill no more than the SMs; else two one-warpgroup programs per SM."""
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    kernel, extra = launch.fused_kernel(pairs, torch.device("cuda"))
    ws = pairs <= 132
    assert (kernel is launch._kda_fused_ws_kernel) == ws
    assert extra == (dict(FACTOR_REGS=launch.FUSED_FACTOR_REGS, maxnreg=launch.FUSED_WS_MAXNREG) if ws else {})


@pytest.mark.parametrize("num_seqs,gate,fits", [(8, False, True), (8, True, False), (9, False, False),
                                                (1, False, False)])
def test_the_check_fits_beside_the_warp_specialised_form_only(hopper, monkeypatch, num_seqs, gate, fits):
    """The g check's small reduction goes beside an inference call's kernels only where the fused forward runs its
    warp-specialised form (8 x 16 = 128 programs on 132 SMs); 144 programs take the one-warpgroup form, a gate or
    too few programs the split kernels."""
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    q, v = _qv()
    assert launch.check_fits_beside(q, v, torch.zeros(16) if gate else None, num_seqs) is fits
