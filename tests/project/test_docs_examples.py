"""The code of the user docs runs: every ```python block of the listed Markdown files is executed on CPU.

A block whose info string is exactly ``python`` is a complete program (its own imports, its own
asserts) and runs in a fresh namespace; ``python no-run`` blocks (FLA / flash-attn code, signatures)
are shown, not run. The blocks use ``backend="auto"`` on CPU tensors, as a user on a CPU machine
would: the Triton interpreter is switched off for them so that ``auto`` resolves to the ``torch``
reference path (fast; the interpreter's kernels are tested elsewhere).
"""
import pathlib
import re

import pytest

import delta_attn as da

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FILES = ["MIGRATION.md", "SERVING.md", "../README.md"]     # relative to docs/
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def blocks(name):
    """(info string, code, line number, heading) of every fenced block of docs/<name>."""
    text = (DOCS / name).read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        heads = re.findall(r"^#+ (.+)$", text[:m.start()], re.M)
        out.append((m.group(1).strip(), m.group(2), line, heads[-1] if heads else ""))
    return out


RUNNABLE = [pytest.param(name, code, line, id=f"{name}:{line}") for name in FILES
            for info, code, line, _ in blocks(name) if info == "python"]


@pytest.mark.parametrize("name, code, line", RUNNABLE)
def test_python_block_runs(name, code, line, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # padded with blank lines: a traceback's line numbers are the lines of the Markdown file
    exec(compile("\n" * line + code, f"docs/{name}", "exec"), {"__name__": "__doc_example__"})


def test_every_block_is_tagged_and_every_section_has_an_example():
    info_strings = {info for info, *_ in blocks("MIGRATION.md")}
    assert info_strings <= {"python", "python no-run"}, info_strings
    runnable_sections = {head for info, _, _, head in blocks("MIGRATION.md") if info == "python"}
    for section in ("flash-attn 2: `flash_attn_func`", "flash-attn 2: `flash_attn_varlen_func`",
                    "flash-attn 2: `flash_attn_with_kvcache`", "The in-kernel gate",
                    "Varlen, `scale`, initial and final states",
                    "FLA `fused_recurrent_kda` → `da.kda` or `da.kda_step`",
                    "FLA `fused_recurrent_hgrn` / `chunk_hgrn` → `da.gated_diag_attn`"):
        assert section in runnable_sections, section
    assert len(RUNNABLE) >= 7


def test_every_public_op_is_in_the_migration_table():
    """The guide's table names a delta-attn function for each flash-attn one it maps."""
    text = (DOCS / "MIGRATION.md").read_text(encoding="utf-8")
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        assert f"| `flash_attn.{name}` | `da.{name}`" in text, name
        assert hasattr(da, name), name
