"""The plot labels of a results folder (bench/plots.py): every bar of ceiling_fraction.png names its op
and no two bars share a label (KDA and diagonal rows of one implementation used to read the same)."""
import pytest

from delta_attn.bench import plots


def _row(impl, op, label="S=1024", direction="fwd", dtype="bf16", frac=0.5):
    quad = op.startswith("flash")
    return {"suite": "kernels", "impl": impl, "op": op, "family": "quadratic" if quad else "linear",
            "label": label, "direction": direction, "dtype": dtype, "status": "ok", "case": {"S": 1024},
            "frac_gemm": frac if quad else None, "frac_copy": None if quad else frac}


def test_kda_and_diag_rows_of_one_impl_get_distinct_labels_naming_the_op():
    rows = [_row("delta-attn triton", "kda"), _row("delta-attn triton", "diag"), _row("delta-attn triton", "flash")]
    labels = plots.bar_labels(rows)
    assert labels == ["delta-attn triton [kda] | S=1024 | fwd", "delta-attn triton [diag] | S=1024 | fwd",
                      "delta-attn triton [flash] | S=1024 | fwd"]


def test_labels_are_unique_across_dtypes_and_repeats():
    rows = [_row("fla", "kda", dtype="bf16"), _row("fla", "kda", dtype="fp16"), _row("fla", "kda", dtype="fp16")]
    labels = plots.bar_labels(rows)
    assert len(set(labels)) == 3
    assert labels[0].endswith("| bf16") and labels[1].endswith("| fp16") and labels[2].endswith("| fp16 #2")
    assert all("[kda]" in lab for lab in labels)
    # one dtype: not repeated in every label
    assert plots.bar_labels([_row("fla", "kda")]) == ["fla [kda] | S=1024 | fwd"]


def test_ceiling_fraction_plot_uses_the_unique_labels(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    ticks = []
    real = plots._plt()

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def subplots(self, *a, **k):
            fig, ax = real.subplots(*a, **k)
            orig = ax.set_yticklabels
            ax.set_yticklabels = lambda labels, **kw: (ticks.extend(labels), orig(labels, **kw))[1]
            return fig, ax

    monkeypatch.setattr(plots, "_plt", lambda: Spy())
    rows = [_row("delta-attn triton", "kda"), _row("delta-attn triton", "diag")]
    made = plots.make_plots(str(tmp_path), {"suite": "kernels"}, rows)
    assert made == ["ceiling_fraction.png"] and (tmp_path / "ceiling_fraction.png").exists()
    assert ticks == plots.bar_labels(rows) and len(set(ticks)) == 2
