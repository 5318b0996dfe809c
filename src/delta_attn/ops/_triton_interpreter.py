"""Compatibility fixes for Triton's CPU interpreter (``TRITON_INTERPRET=1``), applied by every
kernel module on import and only when the interpreter is on. Idempotent; a Triton whose
interpreter has another shape is left alone. Compiled GPU kernels are never affected.

1. Triton 3.6 turns a scalar tensor into a Python int with ``int(array)``; its scalars are
   1-element arrays, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted"),
   so any ``for i in range(start, end)`` with runtime bounds fails: ``__index__`` reads the element.
2. Triton 3.9 gives ``bool vector & bool scalar`` an int32 array, which its masked load/store then
   reject ("mask has unsupported dtype"): masks are cast back to bool before the load/store.
"""
from __future__ import annotations

from .. import settings

_done = False


def _as_bool(mask):
    return mask if mask.dtype == bool else mask.astype(bool)


def patch() -> None:
    global _done
    if _done or not settings.triton_interpreter():
        return
    _done = True
    try:
        from triton.runtime import interpreter as interp
    except Exception:       # pragma: no cover - no triton, or a different layout
        return
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is not None:
        def _patch_lang_tensor(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        interp._patch_lang_tensor = _patch_lang_tensor
    native = getattr(interp, "_interpreter", None)
    if native is not None and hasattr(native, "load") and hasattr(native, "store"):
        class _Native:       # the C module's attributes are read-only: wrap it
            def __getattr__(self, name):
                return getattr(native, name)
        shim = _Native()
        shim.load = lambda ptrs, mask, other, dtype: native.load(ptrs, _as_bool(mask), other, dtype)
        shim.store = lambda ptrs, value, mask: native.store(ptrs, value, _as_bool(mask))
        interp._interpreter = shim
