"""delta_attn.settings: the one place the library reads the environment."""
from __future__ import annotations

import pathlib
import re

import pytest

from delta_attn import settings

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "delta_attn"


@pytest.mark.parametrize("fn, name", [(settings.skip_value_checks, "DELTA_ATTN_SKIP_VALUE_CHECKS"),
                                      (settings.poison_outputs, "DELTA_ATTN_POISON_OUTPUTS")])
def test_flags_parse_and_refuse_unknown_values(fn, name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert fn() is False
    for raw, want in (("1", True), ("TRUE", True), ("on", True), ("0", False), ("", False), ("off", False),
                      ("No", False)):
        monkeypatch.setenv(name, raw)
        assert fn() is want, raw
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=f"{name}.*'maybe'"):
        fn()


@pytest.mark.parametrize("raw", ["1", "true", "Y", "ON", "0", "false", "2", " 1", "", "off"])
def test_triton_interpreter_follows_tritons_rule(raw, monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setenv("TRITON_INTERPRET", raw)
    assert settings.triton_interpreter() is bool(knobs.runtime.interpret)


def test_no_other_module_reads_the_environment():
    reads = re.compile(r"os\.environ\.get|os\.getenv|os\.environ\[|in os\.environ")
    found = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
             if p.name != "settings.py" and reads.search(p.read_text())]
    assert found == [], f"read the environment through delta_attn.settings, not in {found}"
