"""delta-attn: flash attention and linear-time attention (Kimi Delta Attention, gated diagonal
attention) behind one PyTorch API, with a benchmark that measures where each one wins.

>>> import torch, delta_attn as da
>>> q = k = v = torch.randn(1, 8, 2, 16)
>>> da.flash_attn_func(q, k, v, causal=True, backend="torch").shape
torch.Size([1, 8, 2, 16])
"""
from __future__ import annotations

from . import reference
from .backends import Explanation, ReferenceFallbackWarning, UnsupportedError
from .ops.diag.api import gated_diag_attn, gated_diag_step
from .ops.flash.api import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .ops.kda.api import kda, kda_step

__version__ = "0.1.0"

_PUBLIC_OPS = {f.__name__: f for f in (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, kda,
                                        kda_step, gated_diag_attn, gated_diag_step)}


def explain(op, *args, backend: str = "auto", **kwargs) -> Explanation:
    """Which backend ``op(*args, **kwargs)`` would run on, and why every other one was passed over.

    ``op`` is a public operator or its name. Validates the arguments exactly as the call would, runs
    nothing. ``print(da.explain(da.flash_attn_func, q, k, v, causal=True))``.
    """
    fn = _PUBLIC_OPS.get(op) if isinstance(op, str) else op
    if fn is None or getattr(fn, "__name__", None) not in _PUBLIC_OPS:
        raise ValueError(f"op must be one of {', '.join(_PUBLIC_OPS)} (function or name), got {op!r}")
    return fn.plan(*args, backend=backend, **kwargs)


__all__ = [
    "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "kda", "kda_step", "gated_diag_attn",
    "gated_diag_step",
    "explain", "reference", "Explanation", "UnsupportedError", "ReferenceFallbackWarning", "__version__",
]
