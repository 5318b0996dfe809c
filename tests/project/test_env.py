"""`delta-attn env` and the import contract."""
import json
import subprocess
import sys

from delta_attn import cli, env


def test_env_text_reports_versions_gpu_packages_and_backends(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "triton " in out
    assert "GPU: " in out
    assert "nvidia-cudnn-frontend:" in out and "fla-core:" in out
    assert "torch: usable for" in out


def test_env_json_is_machine_readable(capsys):
    assert cli.main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("torch", "cuda", "cudnn", "triton", "gpu", "optional_packages", "backends", "delta_attn"):
        assert key in info
    assert info["backends"]["torch"]["flash"] == []
    assert set(info["optional_packages"]) >= {"nvidia-cudnn-frontend", "fla-core"}


def test_missing_optional_package_names_the_fix():
    info = env.collect()
    info["optional_packages"]["fla-core"] = None
    assert "fla-core: not installed — pip install fla-core (or, in a delta-attn checkout, the extra: " \
           "pip install -e '.[peers]')" in env.render(info)


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "delta_attn.cli", "env"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "delta-attn" in out.stdout


def test_import_compiles_nothing_and_imports_no_optional_package():
    # what `import delta_attn` adds on top of `import torch` (torch itself may import tqdm etc.)
    code = ("import sys, torch; before = set(sys.modules); import delta_attn; "
            "added = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "print(sorted(added & {'triton', 'cudnn', 'fla', 'matplotlib', 'transformers', 'tqdm', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
