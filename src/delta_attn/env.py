"""What this machine offers delta-attn: versions, GPU, optional packages, usable backends.

``collect()`` returns a JSON-able dict (also the environment block of every benchmark report);
``render()`` formats it for ``delta-attn env``. Nothing here compiles a kernel.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import subprocess
from typing import Dict, List, Optional

import torch

from . import __version__, _install, settings
from .backends import BACKENDS, Call, package_available

# optional packages: distribution name -> (import name, how to install it)
OPTIONAL = {
    "nvidia-cudnn-frontend": ("cudnn", _install.CUDNN),
    "fla-core": ("fla", _install.FLA),
    "matplotlib": ("matplotlib", _install.BENCH),
}


def _dist_version(name: str) -> Optional[str]:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _git_revision() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    if shutil.which("git") is None:
        return None
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _driver_version() -> Optional[str]:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _gpu() -> Optional[Dict]:
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "compute_capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2 ** 30, 1), "driver": _driver_version(),
            "count": torch.cuda.device_count()}


def _probe_call(op: str) -> Call:
    on_gpu = torch.cuda.is_available()
    return Call(op=op, device=torch.device("cuda" if on_gpu else "cpu"),
                dtype=torch.bfloat16 if on_gpu else torch.float32, head_dims=(128, 128))


def backend_status() -> Dict[str, Dict[str, List[str]]]:
    """backend -> op -> reasons it cannot run a plain call of that op here ([] = usable)."""
    status = {}
    for name, backend in BACKENDS.items():
        ops = backend.capabilities
        status[name] = {op: backend.not_supported_reasons(_probe_call(op)) for op in ops}
    return status


def collect() -> Dict:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "delta_attn": __version__,
        "git_revision": _git_revision(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "triton": _dist_version("triton"),
        "numpy": _dist_version("numpy"),
        "gpu": _gpu(),
        "optional_packages": {dist: _dist_version(dist) if package_available(mod) else None
                              for dist, (mod, _) in OPTIONAL.items()},
        "triton_interpreter": settings.triton_interpreter(),
        "backends": backend_status(),
    }


def render(info: Dict) -> str:
    gpu = info["gpu"]
    lines = [
        f"delta-attn {info['delta_attn']}" + (f" ({info['git_revision']})" if info["git_revision"] else ""),
        f"python {info['python']} on {info['platform']}",
        f"torch {info['torch']}, CUDA {info['cuda'] or '-'}, cuDNN {info['cudnn'] or '-'}, "
        f"triton {info['triton'] or 'not installed'}",
        ("GPU: " + f"{gpu['name']}, compute capability {gpu['compute_capability']}, {gpu['sm_count']} SMs, "
         f"{gpu['memory_gib']} GiB, driver {gpu['driver'] or '?'}" if gpu else "GPU: no CUDA GPU"),
        "optional packages:",
    ]
    for dist, (_, hint) in OPTIONAL.items():
        ver = info["optional_packages"][dist]
        lines.append(f"  {dist}: {ver}" if ver else f"  {dist}: not installed — {hint}")
    lines.append("backends (a plain call of each operator on this machine):")
    for name, ops in info["backends"].items():
        if not ops:
            lines.append(f"  {name}: implements no operator in this version")
            continue
        usable = [op for op, r in ops.items() if not r]
        lines.append(f"  {name}: usable for {', '.join(usable)}" if usable else f"  {name}: not usable here")
        for op, reasons in ops.items():
            if reasons:
                lines.append(f"    {op}: " + "; ".join(reasons))
    return "\n".join(lines)
