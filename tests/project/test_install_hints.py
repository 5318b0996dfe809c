"""Install hints that work from a checkout (issue 29): each names the package to install, with this project's
extra as the alternative spelled for a checkout (never ``pip install 'delta-attn[...]'``, which asks PyPI for
delta-attn); cuDNN has one route, quoted the same by the code's hints, the README and the docs."""
import pathlib
import re

from delta_attn import _install, backends, env
from delta_attn.bench import impls

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXTS = sorted([ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "src").rglob("*.py"), *(ROOT / "scripts").glob("*.sh")])


def test_every_hint_names_its_package_first():
    for hint, package in ((_install.FLA, "fla-core"), (_install.BENCH, "matplotlib"),
                          (_install.TRANSFORMERS, "'transformers>=4.53'"), (_install.TRITON, "triton"),
                          (_install.CUDNN, "--no-deps 'nvidia-cudnn-frontend>=1.32'")):
        assert hint.startswith(f"pip install {package}"), hint
    for hint, extra in ((_install.FLA, "peers"), (_install.BENCH, "bench"), (_install.TRANSFORMERS, "transformers")):
        assert f"pip install -e '.[{extra}]'" in hint and extra in _pyproject_extras()


def _pyproject_extras():
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("[project.optional-dependencies]")[1].split("\n[")[0]
    return set(re.findall(r"^(\w+) = ", block, re.M))


def test_no_hint_sends_a_checkout_to_pypi_for_delta_attn():
    for path in TEXTS:
        assert "delta-attn[" not in path.read_text(encoding="utf-8"), path


def test_one_route_for_cudnn_everywhere():
    """Every command that installs cuDNN's frontend, in code or docs, is the one route."""
    assert "cudnn" not in _pyproject_extras()
    commands = []
    for path in TEXTS:
        for m in re.finditer(r"pip install[^`\n\"]*nvidia-cudnn-frontend[^`\n\"]*", path.read_text(encoding="utf-8")):
            commands.append((path.name, m.group(0).rstrip(" .;),")))
    assert {c for _, c in commands} == {_install.CUDNN}, commands
    places = {name for name, _ in commands}
    assert {"README.md", "DISPATCH.md", "BENCH.md", "_install.py"} <= places, places


def test_the_code_quotes_the_hints():
    info = env.collect()
    info["optional_packages"].update({"fla-core": None, "nvidia-cudnn-frontend": None})
    text = env.render(info)
    assert f"fla-core: not installed — {_install.FLA}" in text
    assert f"nvidia-cudnn-frontend: not installed — {_install.CUDNN}" in text
    assert impls.FLA_HINT == f"not installed: {_install.FLA}"
    hints = {(name, op): cap.install_hint for name, b in backends.BACKENDS.items()
             for op, cap in list(b.capabilities.items()) + list(b.device_capabilities.items())
             if "cudnn" in cap.requires}
    assert hints and set(hints.values()) == {_install.CUDNN}, hints
