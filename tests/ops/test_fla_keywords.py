"""FLA's keywords passed to delta-attn's KDA (issue 29): a TypeError that says what delta-attn takes instead
(``use_qk_l2norm_in_kernel=True`` -> ``use_qk_l2norm``), for ``da.kda``, ``da.kda_step`` and
``delta_attn.distributed.kda``; docs/MIGRATION.md lists every one."""
import pathlib
import re

import pytest
import torch

import delta_attn as da
import delta_attn.distributed as dd
from delta_attn.ops.kda.api import FLA_KEYWORDS, FLA_STEP_KEYWORDS

B, T, H, K = 1, 3, 2, 8


def _inputs():
    q, k, v = torch.randn(3, B, T, H, K).unbind(0)
    return q, k, v, -torch.rand(B, T, H, K), torch.rand(B, T, H)


@pytest.mark.parametrize("name, ours", [("use_qk_l2norm_in_kernel", "use_qk_l2norm="), ("cu_seqlens_cpu", "cu_seqlens="),
                                        ("use_gate_in_kernel", "A_log="), ("state_v_first", "transpose(-1, -2)"),
                                        ("use_beta_sigmoid_in_kernel", "beta.sigmoid()")])
def test_kda_names_what_to_pass_instead(name, ours):
    with pytest.raises(TypeError, match=rf"^kda\(\) got {name}=, a keyword of FLA's KDA: .*{re.escape(ours)}"):
        da.kda(*_inputs(), **{name: True}, backend="torch")


def test_kda_step_names_the_decode_keywords():
    """fused_recurrent_kda's decode call, as written for FLA: the first FLA keyword is named."""
    with pytest.raises(TypeError, match=r"initial_state=, a keyword of FLA's KDA: kda_step's state"):
        da.kda_step(*_inputs(), initial_state=torch.zeros(B, H, K, K), output_final_state=True)
    state = torch.zeros(B, H, K, K)
    with pytest.raises(TypeError, match="delta-attn's keyword is state_indices="):
        da.kda_step(*_inputs(), state, ssm_state_indices=torch.tensor([0]))
    with pytest.raises(TypeError, match="delta-attn's keyword is use_qk_l2norm="):
        da.kda_step(*_inputs(), state, use_qk_l2norm_in_kernel=True)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'state'"):
        da.kda_step(*_inputs())


def test_a_typo_is_still_pythons_error():
    with pytest.raises(TypeError, match=r"^kda\(\) got an unexpected keyword argument 'output_finalstate'$"):
        da.kda(*_inputs(), output_finalstate=True)


def test_explain_names_them_too():
    """``da.explain`` refuses an FLA keyword as the call does, naming what to pass instead."""
    with pytest.raises(TypeError, match=r"^kda\(\) got use_qk_l2norm_in_kernel=, a keyword of FLA's KDA"):
        da.explain(da.kda, *_inputs(), use_qk_l2norm_in_kernel=True)
    with pytest.raises(TypeError, match="delta-attn's keyword is state_indices="):
        da.explain(da.kda_step, *_inputs(), torch.zeros(B, H, K, K), ssm_state_indices=torch.tensor([0]))
    assert da.explain(da.kda, *_inputs(), use_qk_l2norm=True, backend="torch").chosen == "torch"


def test_context_parallel_kda_names_them_too():
    with pytest.raises(TypeError, match="delta-attn's keyword is use_qk_l2norm="):
        dd.kda(*_inputs(), use_qk_l2norm_in_kernel=True)


def test_the_migration_guide_lists_every_fla_keyword():
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "MIGRATION.md").read_text(encoding="utf-8")
    for name in FLA_STEP_KEYWORDS:
        assert f"`{name}" in text, name
    assert set(FLA_KEYWORDS) <= set(FLA_STEP_KEYWORDS)
