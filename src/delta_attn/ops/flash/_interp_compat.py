"""Compatibility shim for the Triton interpreter (``TRITON_INTERPRET=1``) with NumPy >= 2.4.

Triton 3.6's interpreter turns a scalar tensor into a Python int with ``int(array)``; its scalars
are 1-element arrays, which NumPy 2.4 refuses to convert ("only 0-dimensional arrays can be
converted to Python scalars"), so any ``for i in range(start, end)`` with runtime bounds fails.
:func:`patch` wraps the interpreter's tensor patcher so that ``__index__`` uses ``.item()``.
Idempotent; does nothing when the interpreter module has a different shape.
"""
from __future__ import annotations

_done = False


def patch() -> None:
    global _done
    if _done:
        return
    _done = True
    try:
        from triton.runtime import interpreter as _interp
    except Exception:       # pragma: no cover - no triton / a different layout
        return
    original = getattr(_interp, "_patch_lang_tensor", None)
    if original is None:
        return

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor
