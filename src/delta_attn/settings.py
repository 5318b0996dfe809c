"""The user settings delta-attn reads from the environment: every read goes through this module.

``DELTA_ATTN_SKIP_VALUE_CHECKS`` (default off)
    skip the checks that read ``cu_seqlens`` / ``state_indices`` values (and g, for an explicit cuDNN KDA call) on
    the host (one device-to-host copy per call), keeping launches asynchronous.
``DELTA_ATTN_POISON_OUTPUTS`` (default off)
    fill every floating kernel output with NaN before the kernel runs (what ``delta_attn.testing.poison_outputs()``
    does for a block), so an element a kernel forgot to write shows.
``TRITON_INTERPRET`` (default off)
    Triton's own switch of its CPU interpreter, read with Triton's rule; while on, ``backend="triton"`` runs on CPU
    tensors.

One variable is not a setting but read here all the same: ``WORLD_SIZE``, set by ``torchrun`` (its
rendezvous), tells the scaling benchmark to join torchrun's process group (:func:`launched_by_torchrun`).

Each is read when it is needed (a call, a launch), not at import, so it may be set at any time.
``DELTA_ATTN_*`` values: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``/empty
(case-insensitive); anything else is a ValueError naming the variable. No setting chooses a kernel
or its configuration: that is code (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("", "0", "false", "no", "off", "n")


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 1/true/yes/on or 0/false/no/off (or unset), got {raw!r}")


def skip_value_checks() -> bool:
    """``DELTA_ATTN_SKIP_VALUE_CHECKS``: skip the host reads of ``cu_seqlens`` / ``state_indices`` values."""
    return _flag("DELTA_ATTN_SKIP_VALUE_CHECKS")


def poison_outputs() -> bool:
    """``DELTA_ATTN_POISON_OUTPUTS``: NaN-fill floating kernel outputs before the kernels write them."""
    return _flag("DELTA_ATTN_POISON_OUTPUTS")


def triton_interpreter() -> bool:
    """``TRITON_INTERPRET``: Triton's CPU interpreter is on (Triton's own rule: a true-like value; anything
    else, ``2`` included, is off for Triton and so here; no whitespace stripped, as Triton)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


def launched_by_torchrun() -> bool:
    """``WORLD_SIZE`` is set: the process was started by torchrun (its ``env://`` rendezvous variables)."""
    return "WORLD_SIZE" in os.environ
