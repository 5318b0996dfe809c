"""The occupancy arithmetic of a compiled kernel: the SM limits per compute capability (:data:`SM_TABLE`,
:func:`device_limits`) and resident programs per SM, the limit that binds and the waves of a grid
(:func:`occupancy`), as CUDA's occupancy calculator (``cuda_occupancy.h``) computes them: the least of
the register, shared-memory, thread and block limits.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple


# ------------------------------------------------------------------------------------------ device limits

# Per compute capability: CUDA C Programming Guide, "Technical Specifications per Compute Capability",
# and cuda_occupancy.h (allocation units, sub-partitions, the 1 KiB the driver reserves per block from
# sm_80 on). sm_count is that of the usual part (H100 / H200 SXM: 132); torch's device properties
# replace every figure they carry.
_COMMON = dict(warp_size=32, max_threads_per_block=1024, regs_per_sm=65536, regs_per_block=65536,
               max_regs_per_thread=255, reg_alloc_unit=256, reg_subpartitions=4, smem_alloc_unit=128,
               smem_reserved_per_block=1024)
SM_TABLE: Dict[Tuple[int, int], Dict[str, int]] = {
    (8, 0): dict(_COMMON, sm_count=108, max_threads_per_sm=2048, max_blocks_per_sm=32,
                 smem_per_sm=167936, smem_per_block_optin=166912),
    (8, 6): dict(_COMMON, sm_count=84, max_threads_per_sm=1536, max_blocks_per_sm=16,
                 smem_per_sm=102400, smem_per_block_optin=101376),
    (8, 9): dict(_COMMON, sm_count=128, max_threads_per_sm=1536, max_blocks_per_sm=24,
                 smem_per_sm=102400, smem_per_block_optin=101376),
    (9, 0): dict(_COMMON, sm_count=132, max_threads_per_sm=2048, max_blocks_per_sm=32,
                 smem_per_sm=233472, smem_per_block_optin=232448),
    (10, 0): dict(_COMMON, sm_count=148, max_threads_per_sm=2048, max_blocks_per_sm=32,
                  smem_per_sm=233472, smem_per_block_optin=232448),
}
# torch.cuda.get_device_properties attribute -> our key
_PROPS = {"multi_processor_count": "sm_count", "regs_per_multiprocessor": "regs_per_sm",
          "max_threads_per_multi_processor": "max_threads_per_sm",
          "shared_memory_per_multiprocessor": "smem_per_sm", "shared_memory_per_block_optin": "smem_per_block_optin",
          "warp_size": "warp_size"}


def device_limits(device=None, props=None) -> Dict[str, Any]:
    """The SM limits the occupancy arithmetic needs: the table entry of the device's compute capability
    (sm_90 when unknown), each figure that ``torch.cuda.get_device_properties`` carries replacing the
    table's. ``props``: a properties object (tests pass a stand-in); default: the device's."""
    if props is None and device is not None:
        try:
            import torch
            props = torch.cuda.get_device_properties(device)
        except Exception:  # noqa: BLE001 - no CUDA: the table alone
            props = None
    cc = (getattr(props, "major", None), getattr(props, "minor", None))
    base = SM_TABLE.get(cc) if cc[0] is not None else None
    table_cc = cc if base is not None else (9, 0)
    out: Dict[str, Any] = dict(base or SM_TABLE[(9, 0)])
    from_props = []
    for attr, key in _PROPS.items():
        v = getattr(props, attr, None) if props is not None else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[key] = v
            from_props.append(key)
    out["name"] = getattr(props, "name", None)
    out["compute_capability"] = f"{cc[0]}.{cc[1]}" if cc[0] is not None else None
    out["source"] = (f"torch.cuda.get_device_properties ({', '.join(from_props)}); the rest from the "
                     f"sm_{table_cc[0]}{table_cc[1]} table" if from_props else
                     f"the sm_{table_cc[0]}{table_cc[1]} table (no device properties)")
    return out


# ------------------------------------------------------------------------------------------ occupancy

LIMIT_NAMES = ("registers", "shared memory", "threads", "blocks")


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy(num_warps: int, regs: Optional[int], shared: Optional[int], limits: Dict[str, Any],
              programs: Optional[int] = None, num_ctas: int = 1) -> Dict[str, Any]:
    """Resident programs (thread blocks) per SM and which limit binds, as CUDA's occupancy calculator
    (cuda_occupancy.h) computes them:

    - registers: a warp gets ``ceil(regs * 32 / 256) * 256`` registers; the register file is split
      in 4 sub-partitions of ``regs_per_sm / 4``, each holding ``floor(that / per-warp)`` warps, so
      ``floor(4 * that / warps per block)`` blocks (0 if the block needs more than 64K registers or
      a thread more than 255);
    - shared memory: a block takes ``ceil((shared + 1 KiB reserved) / 128) * 128`` bytes of the SM's
      ``smem_per_sm`` (the largest carve-out: 228 KiB on sm_90); 0 past the per-block opt-in limit
      (227 KiB) plus the reserved KiB;
    - threads: ``floor(max_threads_per_sm / 32 / warps per block)``;
    - blocks: ``max_blocks_per_sm`` (32 on sm_90).

    A limit whose input is unknown (None) is left out. ``programs`` (grid size) gives the waves:
    ``CTAs / (SMs * resident)``, where CTAs = programs x num_ctas. Returns plain numbers."""
    ws = limits["warp_size"]
    warps = max(1, int(num_warps))
    by: Dict[str, Optional[int]] = {}
    # registers
    if regs is None:
        by["registers"] = None
    elif regs <= 0:
        by["registers"] = math.inf
    else:
        per_warp = _round_up(int(regs) * ws, limits["reg_alloc_unit"])
        sub = limits["reg_subpartitions"]
        assumed = per_warp * _round_up(warps, sub)          # the hardware's per-block check
        if regs > limits["max_regs_per_thread"] or per_warp * warps > limits["regs_per_block"] \
                or assumed > limits["regs_per_block"]:
            by["registers"] = 0
        else:
            warps_per_sm = (limits["regs_per_sm"] // sub // per_warp) * sub
            by["registers"] = warps_per_sm // warps
    # shared memory
    if shared is None:
        by["shared memory"] = None
    else:
        alloc = _round_up(int(shared) + limits["smem_reserved_per_block"], limits["smem_alloc_unit"])
        if alloc > limits["smem_per_block_optin"] + limits["smem_reserved_per_block"]:
            by["shared memory"] = 0
        else:
            by["shared memory"] = limits["smem_per_sm"] // alloc
    # threads and blocks
    fits = warps * ws <= limits["max_threads_per_block"]
    by["threads"] = (limits["max_threads_per_sm"] // ws) // warps if fits else 0
    by["blocks"] = limits["max_blocks_per_sm"]
    known = {k: v for k, v in by.items() if v is not None}
    resident_ctas = int(min(known.values()))
    binding = [k for k in LIMIT_NAMES if k in known and known[k] == resident_ctas]
    ctas_per_program = max(1, int(num_ctas))
    out = {
        "programs_per_sm": resident_ctas // ctas_per_program,
        "binding": "+".join(binding),
        "by": {k: (None if v is None else (None if v == math.inf else int(v))) for k, v in by.items()},
        "warps_per_sm": resident_ctas * warps,
        "occupancy": resident_ctas * warps / (limits["max_threads_per_sm"] // ws),
        "unknown": [k for k, v in by.items() if v is None],
        "waves": None,
    }
    if programs is not None and resident_ctas > 0:
        ctas = int(programs) * ctas_per_program
        out["waves"] = ctas / (limits["sm_count"] * resident_ctas)
    return out


def add_occupancy(kernels: List[Dict], limits: Dict[str, Any]) -> List[Dict]:
    for k in kernels:
        c = k.get("config") or {}
        if k.get("source") == "triton" and c.get("num_warps"):
            k["occupancy"] = occupancy(c["num_warps"], k.get("regs"), k.get("shared"), limits,
                                       programs=k.get("programs"), num_ctas=c.get("num_ctas") or 1)
    return kernels
