"""The error rule and output poisoning themselves."""
import torch

from delta_attn import _outputs, testing


def test_error_rule_passes_within_bound_and_fails_beyond():
    ref64 = torch.randn(100, dtype=torch.float64)
    low = ref64 + 1e-3                           # baseline error 1e-3
    assert testing.check(ref64 + 1.9e-3, ref64, low).ok            # within 2x
    assert not testing.check(ref64 + 2.2e-3, ref64, low).ok        # beyond 2x + floor
    assert testing.check(ref64 + 2.9e-3, ref64, low, kind="grad").ok   # gradients: 3x


def test_error_rule_rejects_nan_and_shape_mismatch_and_mismatched_inf():
    ref64 = torch.randn(10, dtype=torch.float64)
    bad = ref64.clone()
    bad[3] = float("nan")
    v = testing.check(bad, ref64, ref64)
    assert not v.ok and "NaN" in v.message
    assert not testing.check(ref64[:5], ref64, ref64).ok
    ref_inf = ref64.clone()
    ref_inf[0] = float("inf")
    assert testing.check(ref_inf.clone(), ref_inf, ref_inf).ok
    assert not testing.check(ref64, ref_inf, ref_inf).ok


def test_poisoned_outputs_start_as_nan():
    with testing.poison_outputs():
        assert torch.isnan(_outputs.empty((4, 3), torch.float16, "cpu")).all()
        assert _outputs.empty((2,), torch.int32, "cpu").dtype == torch.int32     # integers are left alone
    assert not _outputs.poisoning()
