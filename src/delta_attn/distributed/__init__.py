"""Context parallelism over torch.distributed: each rank of ``group`` holds its shard of the sequence
(dim 1 of (B, T, H, D)) and the operators exchange what crosses the shard boundaries.

>>> import delta_attn.distributed as dd        # doctest: +SKIP
>>> o, final_state = dd.kda(q_local, k_local, v_local, g_local, beta_local, output_final_state=True)  # doctest: +SKIP
>>> plan = dd.prepare(cu_seqlens=cu_seqlens)    # once per batch; calls given it never sync  # doctest: +SKIP
>>> o, _ = dd.gated_diag_attn(q_local, k_local, v_local, g_local, plan=plan)  # doctest: +SKIP

Ranks hold consecutive shards in rank order (``layout="contiguous"``); attention also takes
``layout="zigzag"`` (rank r holds chunks r and 2W-1-r of 2W). docs/DISTRIBUTED.md: usage with FSDP and
DeviceMesh, gradients of replicated inputs, and the communication each operator costs.
"""
from __future__ import annotations

from .diag import gated_diag_attn
from .linear import kda
from .plan import Plan, prepare
from .sharding import LAYOUTS, chunk_ranges, local_length, positions, shard, unshard, zigzag_chunks

__all__ = ["shard", "unshard", "kda", "gated_diag_attn", "prepare", "Plan", "LAYOUTS", "chunk_ranges",
           "local_length", "positions", "zigzag_chunks"]

# Attention (its own module) is re-exported where present.
try:
    from .attention import flash_attn_func  # noqa: F401
except ModuleNotFoundError as _e:
    if _e.name != f"{__name__}.attention":
        raise
else:
    __all__.append("flash_attn_func")
    from . import attention as _attention
    if hasattr(_attention, "flash_attn_varlen_func"):
        flash_attn_varlen_func = _attention.flash_attn_varlen_func
        __all__.append("flash_attn_varlen_func")
