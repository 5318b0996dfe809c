"""scripts/test.sh and scripts/main.sh set a machine up by themselves (issue 29): torch is kept when one imports,
else the CPU build comes from PyTorch's CPU index on a machine without an NVIDIA GPU and the default (CUDA)
build from PyPI with one; then delta-attn with the script's extra. Both scripts share scripts/_setup.sh.

The scripts run for real, with a stand-in ``python`` on PATH that logs its arguments (and ``nvidia-smi`` where
a GPU is pretended), so nothing is installed.
"""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"
NO_GPU_HERE = shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0")


def _run(tmp_path, script, *args, torch_imports=False, gpu=False):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "python").write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{log}"\n'
        f'[ "$1" = "-c" ] && exit {0 if torch_imports else 1}\n'
        "exit 0\n")
    (bin_dir / "python").chmod(0o755)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    path = os.pathsep.join([str(bin_dir), os.path.dirname(shutil.which("bash")), "/usr/bin", "/bin"])
    done = subprocess.run(["bash", str(ROOT / "scripts" / script), *args], env={"PATH": path, "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines()


@pytest.mark.skipif(not NO_GPU_HERE, reason="this machine has an NVIDIA GPU")
def test_test_sh_installs_the_cpu_torch_without_a_gpu(tmp_path):
    assert _run(tmp_path, "test.sh", "-k", "x") == [
        "-c import torch",
        f"-m pip install -q torch==2.13.0 {CPU_INDEX}",
        "-m pip install -q -e .[test]",
        "-m ruff check src",
        "-m pytest -q -n 2 -k x",
    ]


@pytest.mark.skipif(not NO_GPU_HERE, reason="this machine has an NVIDIA GPU")
def test_main_sh_shares_the_set_up(tmp_path):
    assert _run(tmp_path, "main.sh", "--quick") == [
        "-c import torch",
        f"-m pip install -q torch==2.13.0 {CPU_INDEX}",
        "-m pip install -q -e .[bench]",
        "-m delta_attn.cli env",
        "-m delta_attn.cli bench crossover --quick",
    ]


def test_the_cuda_build_with_a_gpu(tmp_path):
    calls = _run(tmp_path, "test.sh", gpu=True)
    assert calls[1] == "-m pip install -q torch==2.13.0"


def test_an_importable_torch_is_kept(tmp_path):
    assert _run(tmp_path, "main.sh", torch_imports=True)[:2] == ["-c import torch", "-m pip install -q -e .[bench]"]
