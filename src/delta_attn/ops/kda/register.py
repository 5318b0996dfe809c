"""What each backend supports for Kimi Delta Attention (``kda``, ``kda_step``): the capability declarations of
the registry (``delta_attn/backends.py``), registered once when the package is imported (``ops/kda/__init__.py``).
Implementations are ``"module:function"`` strings imported on first use; ``cudnn.py`` (what the cuDNN backend
declares and refuses) imports no cudnn package until a call runs."""
from __future__ import annotations

import torch

from ... import _checks as C
from ... import _install
from ...backends import Capability, register
from . import cudnn

_PKG = "delta_attn.ops.kda"
FEATURES = frozenset({"varlen", "initial_state", "final_state", "qk_l2norm", "gate_softplus",
                      "gate_lower_bound", "gva", "state_indices", "speculative", "strong_decay"})
_TORCH = dict(device_types=("cpu", "cuda", "mps", "xpu"), dtypes=C.FLOAT_DTYPES, features=FEATURES)


def _triton_head_dims(dims):
    kd, vd = dims
    for name, d in (("K", kd), ("V", vd)):
        if d % 16 != 0 or d > 256:
            return f"head dim {name} = {d} unsupported: the triton KDA kernels need a multiple of 16 up to 256"
    return None


# CPU tensors under TRITON_INTERPRET=1 only (the registry's device rule)
_TRITON = dict(device_types=("cuda", "cpu"), dtypes=(torch.float16, torch.bfloat16, torch.float32),
               features=FEATURES, requires=("triton",), install_hint=_install.TRITON, head_dims=_triton_head_dims)


def register_backends() -> None:
    """Declare every backend of ``kda`` and ``kda_step``."""
    register("torch", "kda", Capability(impl=f"{_PKG}.torch_impl:kda", **_TORCH))
    register("torch", "kda_step", Capability(impl=f"{_PKG}.torch_impl:kda_step", backward=False, **_TORCH))
    register("triton", "kda", Capability(impl=f"{_PKG}.autograd:kda", **_TRITON))
    register("triton", "kda_step", Capability(impl=f"{_PKG}.autograd:kda_step", backward=False, **_TRITON))
    # backend="cudnn": cuDNN frontend's KDA op (sm_90 engine); what it declares and refuses is in cudnn.py
    register("cudnn", "kda", Capability(
        impl=f"{_PKG}.cudnn:kda", dtypes=cudnn.DTYPES, features=cudnn.FEATURES, min_compute_capability=cudnn.SM90,
        requires=("cudnn",), install_hint=cudnn.INSTALL_HINT, head_dims=cudnn.head_dims, check=cudnn.check))
