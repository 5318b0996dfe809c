"""The Gluon kernels of KDA training (intra-chunk forward, the two state scans, the intra-chunk backward) on the CPU
emulator (``tests/gluon_emulator.py``): the GPU suites' checks (tests/gpu/test_kda_intra_fused_gpu.py,
test_kda_scan_gpu.py, test_kda_bwd_fused_gpu.py: each Gluon kernel against the Triton kernel it replaces on the same
inputs, and the whole gradients against the float64 reference with the error rule) run on CPU tensors, each GPU module
loaded a second time with its device set to the CPU. The emulator adds its ordering and bounds checks (cp.async,
barriers, fences, asynchronous wgmma); the Triton kernels beside the Gluon ones run on the interpreter with the GPU's
bfloat16 arithmetic. What it cannot show (races inside one barrier interval, register and shared-memory limits,
the compiled code) the GPU suites do.

The kernel-against-kernel checks run the Triton path on the interpreter (minutes each): they are marked slow (run
with ``--slow``); the whole gradients against float64 run in every CPU suite."""
from __future__ import annotations

import kda_gluon_cases as C
import pytest

from delta_attn.ops import _gluon

pytestmark = pytest.mark.skipif(_gluon.gluon is None, reason="Triton without Gluon")

if _gluon.gluon is not None:
    import gluon_emulator as E
    INTRA = E.gpu_module_on_cpu("test_kda_intra_fused_gpu")
    SCAN = E.gpu_module_on_cpu("test_kda_scan_gpu")
    BWD = E.gpu_module_on_cpu("test_kda_bwd_fused_gpu")


@pytest.fixture
def cpu(monkeypatch):
    with E.on_cpu(monkeypatch):
        yield monkeypatch


@pytest.mark.slow
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("B,T,H,HV,decay,cu", INTRA.CASES)
def test_intra_forward_against_triton(B, T, H, HV, decay, cu, l2, cpu):
    INTRA.test_gluon_against_triton(B, T, H, HV, decay, cu, l2, cpu, INTRA.spy_intra(cpu))


@pytest.mark.parametrize("nan", [False, True])
def test_intra_forward_reports_a_positive_decay(nan, cpu):
    INTRA.test_positive_decay_reported_by_the_kernel(nan, cpu, INTRA.spy_intra(cpu))


@pytest.mark.slow
@pytest.mark.parametrize("tiling", SCAN.TILINGS)
@pytest.mark.parametrize("B,T,H,HV,cu,mean", SCAN.CASES)
def test_forward_scan_against_triton(B, T, H, HV, cu, mean, tiling, cpu):
    SCAN.test_gluon_forward_scan_against_triton(B, T, H, HV, cu, mean, SCAN.force_tiles(cpu, *tiling), cpu)


@pytest.mark.slow
@pytest.mark.parametrize("tiling", SCAN.TILINGS)
@pytest.mark.parametrize("B,T,H,HV,cu,mean", SCAN.CASES)
def test_reverse_scan_against_triton(B, T, H, HV, cu, mean, tiling, cpu):
    SCAN.test_gluon_reverse_scan_against_triton(B, T, H, HV, cu, mean, SCAN.force_tiles(cpu, *tiling), cpu,
                                                SCAN.spy_scans(cpu))


@pytest.mark.slow
@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("B,T,H,HV,decay,cu", BWD.CASES)
def test_backward_against_triton(B, T, H, HV, decay, cu, l2, cpu):
    BWD.test_gluon_against_triton_factored_launch(B, T, H, HV, decay, cu, l2, cpu, BWD.spy_factored(cpu))


@pytest.mark.parametrize("B,T,cu,H,HV,l2,decay,fp32_gb", C.WHOLE)
def test_whole_gradients_against_float64(B, T, cu, H, HV, l2, decay, fp32_gb, cpu):
    BWD.test_whole_gradients_against_float64(B, T, cu, H, HV, l2, decay, fp32_gb, BWD.spy_factored(cpu))


@pytest.mark.parametrize("l2", [True, False])
def test_bf16_g_and_beta_read_as_given(l2, cpu):
    BWD.test_bf16_g_and_beta_read_as_given(l2, cpu)


@pytest.mark.slow
def test_backward_nan_groups_flagged_as_triton(cpu):
    BWD.test_nan_groups_flagged_as_triton(cpu, BWD.spy_factored(cpu))
