"""Figures and requirements that appear in several places say the same thing everywhere (issue 29)."""
import ast
import pathlib
import re

import torch

import delta_attn as da

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _minimum(text, pattern):
    m = re.search(pattern, text)
    assert m, pattern
    return tuple(int(x) for x in m.group(1).split("."))


def test_one_python_minimum_and_the_code_runs_on_it():
    """pyproject's requires-python is the README's; no source file uses syntax newer than it."""
    ours = _minimum((ROOT / "pyproject.toml").read_text(), r'requires-python = ">=(\d+\.\d+)"')
    assert _minimum((ROOT / "README.md").read_text(encoding="utf-8"), r"Python ≥ (\d+\.\d+)") == ours
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "examples").glob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        ast.parse(path.read_text(encoding="utf-8"), str(path), feature_version=ours)


def _speedups(text):
    """Every "A-B×" / "A–Bx" range in ``text``."""
    return set(re.findall(r"(\d+(?:\.\d+)?)[–-](\d+(?:\.\d+)?) ?[x×]", text))


def test_the_cpu_sdpa_speed_up_is_quoted_as_measured(monkeypatch):
    """README, docs/DISPATCH.md's dispatch table and ``explain`` quote the forward range of the measured table."""
    dispatch = (ROOT / "docs" / "DISPATCH.md").read_text(encoding="utf-8")
    table = dispatch.split("### CPU: PyTorch SDPA's kernel against the reference")[1].split("\n\n")[1]
    fwd = [float(line.split("|")[5].strip().rstrip("x")) for line in table.splitlines()[2:]]
    measured = (f"{min(fwd):.1f}", f"{max(fwd):.1f}")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 8, 2, 16)
    explained = str(da.explain(da.flash_attn_func, q, q, q))
    readme = (ROOT / "README.md").read_text(encoding="utf-8").replace("\n", " ")
    quotes = {"README.md": readme.split("PyTorch's SDPA CPU kernel")[1][:200],
              "DISPATCH.md": next(line for line in dispatch.splitlines() if line.startswith("| CPU tensors |")),
              "explain": explained.split("SDPA's CPU kernel")[1][:100]}
    for where, text in quotes.items():
        assert measured == sorted(_speedups(text), key=lambda r: float(r[0]))[-1], (where, text)
