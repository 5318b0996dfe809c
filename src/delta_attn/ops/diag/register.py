"""What each backend supports for gated diagonal attention (``diag``, ``diag_step``): the capability
declarations of the registry (``delta_attn/backends.py``), registered once when the package is imported
(``ops/diag/__init__.py``). Implementations are ``"module:function"`` strings imported on first use."""
from __future__ import annotations

import torch

from ... import _checks as C
from ... import _install
from ...backends import Capability, register

_PKG = "delta_attn.ops.diag"
FEATURES = frozenset({"varlen", "initial_state", "final_state", "state_indices", "speculative"})
_TORCH = dict(device_types=("cpu", "cuda", "mps", "xpu"), dtypes=C.FLOAT_DTYPES, features=FEATURES)
# CPU tensors under TRITON_INTERPRET=1 only (the registry's device rule)
_TRITON = dict(device_types=("cuda", "cpu"), dtypes=(torch.float16, torch.bfloat16, torch.float32),
               features=FEATURES, requires=("triton",), install_hint=_install.TRITON)


def register_backends() -> None:
    """Declare every backend of ``diag`` and ``diag_step``."""
    register("torch", "diag", Capability(impl=f"{_PKG}.torch_impl:gated_diag", **_TORCH))
    register("torch", "diag_step", Capability(impl=f"{_PKG}.torch_impl:gated_diag_step", backward=False, **_TORCH))
    register("triton", "diag", Capability(impl=f"{_PKG}.autograd:gated_diag", **_TRITON))
    register("triton", "diag_step", Capability(impl=f"{_PKG}.autograd:gated_diag_step", backward=False, **_TRITON))
