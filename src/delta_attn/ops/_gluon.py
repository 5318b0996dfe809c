"""Triton's Gluon (explicit register layouts), where the installed Triton has the version our Gluon kernels are
tested with: ``gluon`` / ``gl`` are its modules, or None. A kernel with a Gluon variant runs it on CUDA when
:func:`available`, and its Triton kernel otherwise (the CPU interpreter, an older Triton): the same program and
results, with the layout chosen by Triton (docs/DISPATCH.md)."""
from __future__ import annotations

import functools

import triton

from .. import settings

MIN_TRITON = (3, 6)         # Gluon's API moves between releases: the oldest version the kernels run on
KERNELS_TRITON = (3, 6)     # the release whose Gluon API the sm_90 KDA kernels are written for (wgmma, cp.async)


@functools.lru_cache(maxsize=None)
def version() -> tuple:
    """(major, minor) of the installed Triton (parsed once: the dispatch of every call asks)."""
    parts = []
    for p in triton.__version__.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


gluon = gl = None
if version() >= MIN_TRITON:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
    except ImportError:         # pragma: no cover - a build without Gluon
        gluon = gl = None


def available(device) -> bool:
    """Whether a Gluon kernel may run on ``device``: CUDA, Gluon importable, the interpreter off."""
    return gluon is not None and device.type == "cuda" and not settings.triton_interpreter()


def kernels_release(device) -> bool:
    """Whether the sm_90 Gluon kernels written for ``KERNELS_TRITON`` may run on ``device`` as far as Triton goes:
    :func:`available` and that release installed (the device's architecture is the caller's to check)."""
    return available(device) and version() == KERNELS_TRITON
