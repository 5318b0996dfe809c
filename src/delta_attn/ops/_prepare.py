"""What a Triton kernel receives, prepared in one place (re-exported by :mod:`delta_attn.ops._launch`).

Kernels address index and parameter tensors as ``ptr + i`` (unit stride) and never read the pointer of
an absent optional input. Every launcher hands them its tensors through these helpers, so a strided
view of ``cu_seqlens``, ``state_indices``, ``A_log``, ``alibi_slopes``, a state... can never reach a
kernel as it is. Each returns its argument itself when it already has the required form (no copy).
Plain torch: importing this imports no Triton.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .._checks import as_int32

Tensor = torch.Tensor


# an index tensor (``cu_seqlens``, ``state_indices``, chunk tables) as contiguous int32: the form validation
# hands to backends (call after its values are checked: an int64 value beyond int32 would wrap)
index = as_int32


def param(t: Optional[Tensor], dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    """A tensor the kernel reads as one dense block (operands, parameters such as ``A_log``, states):
    contiguous, cast to ``dtype`` when given."""
    if t is None:
        return None
    return (t if dtype is None else t.to(dtype)).contiguous()


def unit_last(t: Tensor) -> Tensor:
    """A tensor the kernel addresses through its strides except the last dim, which must be unit."""
    return t if t.stride(-1) == 1 else t.contiguous()


_DUMMIES: Dict[Tuple[torch.device, torch.dtype], Tensor] = {}


def optional(t: Optional[Tensor], like: Tensor) -> Tensor:
    """``t``, or for an absent input a one-element placeholder of ``like``'s dtype and device (one cached
    per device and dtype): the kernel gets a valid pointer that its constexpr flag keeps it from reading."""
    if t is not None:
        return t
    key = (like.device, like.dtype)
    dummy = _DUMMIES.get(key)
    if dummy is None:
        dummy = _DUMMIES[key] = torch.zeros(1, dtype=like.dtype, device=like.device)
    return dummy


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for the CPU interpreter, where grids run in order)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on a CUDA device (Triton's driver query)."""
    from triton.runtime import driver
    return int(driver.active.utils.get_device_properties(device.index)["max_shared_mem"])


def positive_max_on_gpu(x: torch.Tensor, stream):
    """``ops/_decay_max.start_positive_max``, the g <= 0 check's reduction for ``_checks.PendingChecks``, imported
    on the first call (it holds a Gluon kernel: importing the operators imports no Triton)."""
    from ._decay_max import start_positive_max
    return start_positive_max(x, stream)
