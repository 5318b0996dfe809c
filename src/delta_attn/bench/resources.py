"""Per-kernel resource report of a bench row: the Triton kernels a row launches with their
configuration, registers, spills, shared memory, grid and occupancy; the row's place on the roofline
of the ceilings measured in the same run; the peers' kernels named through the PyTorch profiler.

How kernels are captured (Triton 3.6; the same API in 3.9). Every launch of a compiled Triton kernel,
through ``JITFunction.run`` (what ``kernel[grid](...)``, ``triton.autotune`` and ``triton.heuristics``
end in) or ``CompiledKernel[grid](...)``, goes through two steps:

1. ``CompiledKernel.launch_metadata(grid, stream, *args)`` loads the binary if needed
   (``_init_handles``: this sets ``n_regs``, the registers per thread, and ``n_spills``, the local
   memory per thread in 4-byte words, both read by Triton's driver with ``cuFuncGetAttribute``) and
   returns a ``LazyDict`` holding only ``{"name", "function", "stream"}``.
2. The generated C launcher calls ``triton.knobs.runtime.launch_enter_hook`` (a ``HookChain``:
   ``add`` / ``remove``) with that ``LazyDict`` just before ``cuLaunchKernelEx``.

The hook therefore names the kernel but carries neither its configuration nor its grid. While a
capture is active, :class:`TritonLaunchCapture` wraps ``CompiledKernel.launch_metadata`` (restored
on exit) to tag the ``LazyDict`` with ``(compiled kernel, grid)``, and the hook records the tag:
``compiled.metadata`` (a namedtuple read from the kernel's JSON: ``name``, ``num_warps`` (all warps,
warp-specialised partitions included), ``num_stages``, ``num_ctas``, ``shared`` (dynamic shared
memory per program, bytes), ``maxnreg``, ``target``), ``compiled.n_regs`` / ``n_spills``, and
``compiled.src.constants`` (the constexpr values: tile sizes) named through
``compiled.src.fn.arg_names``. Launches made while ``triton.autotune`` benchmarks its candidates
(``Autotuner._bench``) are counted but not listed. Nothing is launched or compiled for the capture:
it only watches the call the protocol makes anyway. Under the Triton interpreter
(``TRITON_INTERPRET=1``) nothing is compiled and the capture returns the reason instead.

Occupancy follows CUDA's occupancy calculator (``cuda_occupancy.h``): resident programs per SM =
the least of the register, shared-memory, thread and block limits (see :func:`occupancy`).
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict, defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .. import settings

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


# ------------------------------------------------------------------------------------------ parsing

def _plain(v):
    """A JSON-safe value: numbers, strings, bools and None as they are; sequences as lists; anything
    else (a tl.dtype, a GPUTarget) as its string."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


def _get(obj, key, default=None):
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def parse_metadata(meta) -> Dict[str, Any]:
    """The fields of a compiled kernel's metadata (Triton's ``KernelMetadata`` namedtuple, or a dict
    with the same keys) that the report uses."""
    target = _get(meta, "target")
    arch = _get(target, "arch") if target is not None else None
    return {"name": _get(meta, "name"), "num_warps": _get(meta, "num_warps"), "num_stages": _get(meta, "num_stages"),
            "num_ctas": _get(meta, "num_ctas", 1) or 1, "shared": _get(meta, "shared"),
            "maxnreg": _get(meta, "maxnreg"), "arch": _plain(arch if arch is not None else _get(meta, "arch")),
            "warp_size": _get(meta, "warp_size") or (_get(target, "warp_size") if target is not None else None) or 32}


def constexprs_of(src) -> Dict[str, Any]:
    """The constexpr arguments a kernel was specialised with (tile sizes, flags), by name, from an
    ``ASTSource``: ``constants`` is keyed by argument paths (``(index,)``), named through
    ``fn.arg_names``; only parameters declared ``tl.constexpr`` are kept when ``fn.params`` says which."""
    if src is None:
        return {}
    consts = _get(src, "constants") or {}
    fn = _get(src, "fn")
    names = list(_get(fn, "arg_names", None) or [])
    params = list(_get(fn, "params", None) or [])
    out: Dict[str, Any] = {}
    for path, value in consts.items():
        idx = path[0] if isinstance(path, tuple) and path else path
        if isinstance(idx, str):
            name, i = idx, (names.index(idx) if idx in names else None)
        elif isinstance(idx, int) and idx < len(names):
            name, i = names[idx], idx
        else:
            continue
        if i is not None and i < len(params) and not bool(getattr(params[i], "is_constexpr", True)):
            continue
        if isinstance(path, tuple) and len(path) > 1:
            name += "".join(f"[{p}]" for p in path[1:])
        out[name] = _plain(value)
    return out


def _grid3(grid) -> List[int]:
    g = [int(x) for x in (grid if isinstance(grid, (list, tuple)) else (grid,))][:3]
    return g + [1] * (3 - len(g))


def parse_launch(compiled, grid, phase: str = "fwd", name: Optional[str] = None) -> Dict[str, Any]:
    """One launch as a plain dict: kernel name, config (constexprs, warps, stages, CTAs per program),
    registers per thread and spills (local memory, 4-byte words per thread, as Triton reads
    ``CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES`` / 4), shared bytes per program, grid and programs."""
    if compiled is None:
        return {"source": "triton", "kernel": name, "phase": phase, "config": {}, "regs": None, "spills": None,
                "shared": None, "grid": None, "programs": None, "launches": 1}
    md = parse_metadata(_get(compiled, "metadata"))
    g = _grid3(grid) if grid is not None else None
    regs, spills = _get(compiled, "n_regs"), _get(compiled, "n_spills")
    return {
        "source": "triton",
        "kernel": _get(compiled, "name") or md["name"] or name,
        "phase": phase,
        "config": {"constexprs": constexprs_of(_get(compiled, "src")), "num_warps": md["num_warps"],
                   "num_stages": md["num_stages"], "num_ctas": md["num_ctas"], "maxnreg": md["maxnreg"]},
        "arch": md["arch"],
        "regs": None if regs is None else int(regs),
        "spills": None if spills is None else int(spills),
        "shared": None if md["shared"] is None else int(md["shared"]),
        "grid": g,
        "programs": None if g is None else g[0] * g[1] * g[2],
        "launches": 1,
    }


def _config_key(k: Dict) -> Tuple:
    c = k.get("config") or {}
    return (k.get("phase"), k.get("kernel"), tuple(sorted((c.get("constexprs") or {}).items(), key=str)),
            c.get("num_warps"), c.get("num_stages"), c.get("num_ctas"), tuple(k.get("grid") or ()))


def group_launches(records: Iterable[Dict]) -> List[Dict]:
    """Launches of the same kernel with the same config and grid in the same phase merged into one
    entry (``launches`` counts them), in order of first launch."""
    out: "OrderedDict[Tuple, Dict]" = OrderedDict()
    for r in records:
        key = _config_key(r)
        if key in out:
            out[key]["launches"] += r.get("launches", 1)
        else:
            out[key] = dict(r)
    return list(out.values())


def add_occupancy(kernels: List[Dict], limits: Dict[str, Any]) -> List[Dict]:
    for k in kernels:
        c = k.get("config") or {}
        if k.get("source") == "triton" and c.get("num_warps"):
            k["occupancy"] = occupancy(c["num_warps"], k.get("regs"), k.get("shared"), limits,
                                       programs=k.get("programs"), num_ctas=c.get("num_ctas") or 1)
    return kernels


# ------------------------------------------------------------------------------------------ capture

INTERPRETER_REASON = ("the Triton kernels ran through the interpreter (TRITON_INTERPRET=1), which compiles "
                      "nothing: there are no registers, spills or shared memory to read")


def _triton_api():
    """(hook registry, CompiledKernel class, Autotuner class or None, Triton version), or a string
    saying why this Triton has no usable launch hook."""
    try:
        import triton
        from triton.compiler import compiler as tc
    except Exception as e:  # noqa: BLE001
        return f"Triton is not importable ({type(e).__name__}: {e})"
    version = getattr(triton, "__version__", "?")
    ck = getattr(tc, "CompiledKernel", None)
    if ck is None or not hasattr(ck, "launch_metadata"):
        return f"Triton {version}: CompiledKernel.launch_metadata not found"
    try:
        from triton.runtime.autotuner import Autotuner
    except Exception:  # noqa: BLE001
        Autotuner = None
    knobs = getattr(triton, "knobs", None)
    chain = getattr(getattr(knobs, "runtime", None), "launch_enter_hook", None)
    if chain is not None and hasattr(chain, "add") and hasattr(chain, "remove"):
        return _HookChainRegistry(chain), ck, Autotuner, version           # Triton >= 3.4 (3.6, 3.9)
    if knobs is not None and hasattr(getattr(knobs, "runtime", None), "launch_enter_hook"):
        return _AttrRegistry(knobs.runtime, "launch_enter_hook"), ck, Autotuner, version   # knobs, one callable
    if hasattr(ck, "launch_enter_hook"):
        return _AttrRegistry(ck, "launch_enter_hook"), ck, Autotuner, version             # Triton 3.0 - 3.2
    return f"Triton {version} exposes no launch hook (neither knobs.runtime.launch_enter_hook nor " \
           f"CompiledKernel.launch_enter_hook)"


class _HookChainRegistry:
    def __init__(self, chain):
        self.chain = chain

    def add(self, fn):
        self.chain.add(fn)

    def remove(self, fn):
        self.chain.remove(fn)


class _AttrRegistry:
    """A hook slot holding one callable (older Triton): ours is chained in front of any present one."""

    def __init__(self, owner, attr):
        self.owner, self.attr, self.previous = owner, attr, None

    def add(self, fn):
        self.previous = getattr(self.owner, self.attr)
        prev = self.previous

        def chained(md):
            fn(md)
            if prev is not None:
                prev(md)
        setattr(self.owner, self.attr, chained)

    def remove(self, fn):
        setattr(self.owner, self.attr, self.previous)


_ACTIVE = [None]          # the capture in progress (one at a time)
_TAG = "_delta_attn_launch"


class TritonLaunchCapture:
    """Context manager: records every Triton kernel launch made inside it (see the module docstring).

    ``reason``: None when launches are being recorded, else why not (CPU / interpreter, no Triton,
    no hook API, another capture active). ``mark(phase)`` tags later launches (``"bwd"`` before a
    backward pass); ``stop()`` ends recording early (the hooks are removed on exit in any case).
    ``launches()``: the recorded launches as dicts (autotuning excluded, ``autotune_launches`` counts
    them). ``api``: a stand-in for :func:`_triton_api`'s tuple (tests; the CPU / interpreter checks are
    then skipped)."""

    def __init__(self, device=None, api=None):
        self.device = device
        self._api = api
        self.reason: Optional[str] = None
        self.phase = "fwd"
        self.raw: List[Tuple] = []
        self.autotune_launches = 0
        self.version: Optional[str] = None
        self._active = False
        self._tuning = 0
        self._pending = None
        self._undo: List[Callable[[], None]] = []

    # -------------------------------------------------------------- hooks
    def _hook(self, md) -> None:
        try:                                   # a hook that raises would fail the kernel launch
            if not self._active:
                return
            entry = getattr(md, _TAG, None) or self._pending
            self._pending = None
            if self._tuning > 0:
                self.autotune_launches += 1
                return
            if entry is not None:
                self.raw.append((entry[0], entry[1], self.phase, None))
            else:
                data = getattr(md, "data", None)
                self.raw.append((None, None, self.phase, data.get("name") if isinstance(data, dict) else None))
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> "TritonLaunchCapture":
        dev = self.device
        dev_type = getattr(dev, "type", dev)
        if self._api is None:      # a stand-in API (tests) skips the device checks
            if dev_type is not None and dev_type != "cuda":
                self.reason = (("CPU run: " + INTERPRETER_REASON) if settings.triton_interpreter()
                               else "CPU run: no compiled kernels")
                return self
            if settings.triton_interpreter():
                self.reason = INTERPRETER_REASON
                return self
        api = self._api if self._api is not None else _triton_api()
        if isinstance(api, str):
            self.reason = api
            return self
        if _ACTIVE[0] is not None:
            self.reason = "another launch capture is active"
            return self
        registry, ck_cls, tuner_cls, self.version = api
        cap = self
        orig_md = ck_cls.__dict__.get("launch_metadata", ck_cls.launch_metadata)

        def launch_metadata(ck, grid, stream, *args):
            md = orig_md(ck, grid, stream, *args)
            if cap._active:
                entry = (ck, tuple(grid) if isinstance(grid, (list, tuple)) else (grid,))
                cap._pending = entry
                if md is not None:
                    try:
                        setattr(md, _TAG, entry)
                    except Exception:  # noqa: BLE001 - the pending slot carries it
                        pass
            return md

        own = "launch_metadata" in ck_cls.__dict__
        ck_cls.launch_metadata = launch_metadata
        self._undo.append(lambda: setattr(ck_cls, "launch_metadata", orig_md) if own
                          else delattr(ck_cls, "launch_metadata"))
        if tuner_cls is not None and hasattr(tuner_cls, "_bench"):
            orig_bench = tuner_cls.__dict__.get("_bench", tuner_cls._bench)
            own_bench = "_bench" in tuner_cls.__dict__

            def _bench(tuner, *a, **k):
                cap._tuning += 1
                try:
                    return orig_bench(tuner, *a, **k)
                finally:
                    cap._tuning -= 1
            tuner_cls._bench = _bench
            self._undo.append(lambda: setattr(tuner_cls, "_bench", orig_bench) if own_bench
                              else delattr(tuner_cls, "_bench"))
        registry.add(self._hook)
        self._undo.append(lambda: registry.remove(self._hook))
        _ACTIVE[0] = self
        self._active = True
        return self

    def mark(self, phase: str) -> None:
        self.phase = phase

    def stop(self) -> None:
        self._active = False
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:  # noqa: BLE001
                pass
        if _ACTIVE[0] is self:
            _ACTIVE[0] = None

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def launches(self) -> List[Dict]:
        return [parse_launch(ck, grid, phase, name) for ck, grid, phase, name in self.raw]


# ------------------------------------------------------------------------------------------ profiler

def summarize_device_events(events: Iterable[Tuple[str, float]]) -> List[Dict]:
    """(name, device µs) pairs of one profiled call -> [{kernel, launches, device_us}], the longest
    first. Copies and sets (``Memcpy ...``, ``Memset ...``) are kept under their names."""
    acc: Dict[str, List[float]] = OrderedDict()
    for name, us in events:
        acc.setdefault(str(name), []).append(float(us))
    out = [{"source": "profiler", "kernel": n, "launches": len(v), "device_us": sum(v)} for n, v in acc.items()]
    out.sort(key=lambda k: -k["device_us"])
    return out


def _device_events(prof) -> List[Tuple[str, float]]:
    """(name, µs) of every device-side event of a finished torch.profiler session."""
    from torch.autograd import DeviceType
    out = []
    for e in prof.events():
        if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU:
            continue
        tr = getattr(e, "time_range", None)
        us = tr.elapsed_us() if tr is not None else getattr(e, "device_time_total", 0.0)
        out.append((e.name, float(us)))
    return out


class ProfilerCapture:
    """Context manager: the device kernels launched inside it, by name, with their summed device time,
    through ``torch.profiler`` (CUDA activity; the session synchronises on exit). For peers whose
    kernels are not Triton's (cuDNN, FlashAttention-2) this is where their names come from. ``kernels``
    (a list) after exit, or ``reason`` when the profiler could not run."""

    def __init__(self):
        self.kernels: Optional[List[Dict]] = None
        self.reason: Optional[str] = None
        self._prof = None

    def __enter__(self) -> "ProfilerCapture":
        try:
            from torch.profiler import ProfilerActivity, profile
            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.__enter__()
        except Exception as e:  # noqa: BLE001
            self._prof, self.reason = None, f"torch.profiler did not start: {type(e).__name__}: {e}"
        return self

    def stop(self) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        try:
            prof.__exit__(None, None, None)
            self.kernels = summarize_device_events(_device_events(prof))
        except Exception as e:  # noqa: BLE001
            self.reason = f"torch.profiler failed: {type(e).__name__}: {e}"

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False


def profile_kernels(fn: Callable[[], Any]) -> Tuple[Any, ProfilerCapture]:
    """Run ``fn`` once under :class:`ProfilerCapture` (wrap a call that runs anyway, e.g. the warm call):
    returns ``(fn's result, capture)``; ``capture.kernels`` names the kernels and their device µs."""
    with ProfilerCapture() as cap:
        out = fn()
    return out, cap


# ------------------------------------------------------------------------------------------ roofline

def linear_flops(case: Dict, direction: str) -> Optional[float]:
    """A lower bound on the FLOPs of the linear operators (no agreed count exists; the chunked kernels
    do more), from their recurrent form, per token and head: KDA (7·D² + 2·D: decay the D×D state,
    kᵀS, the delta-rule outer-product update, qᵀS), diagonal 4·D (h = a·h + k·v, o = q·h). Backward
    2x the forward, fwd+bwd 3x. None for other operators."""
    op = case.get("op")
    d, h = case.get("D"), case.get("H")
    if d is None or h is None:
        return None
    if op in ("kda", "kda_decode"):
        per = 7 * d * d + 2 * d
    elif op in ("diag", "diag_decode"):
        per = 4 * d
    else:
        return None
    tokens = case["B"] * (1 if op.endswith("decode") else case["S"])
    return float(per * tokens * h) * {"fwd": 1.0, "bwd": 2.0, "fwd+bwd": 3.0}.get(direction, 1.0)


def roofline(flops: Optional[float], nbytes: Optional[float], ms: Optional[float], ceilings: Dict) -> Optional[Dict]:
    """A row against the run's ceilings (``copy_gbps``, ``gemm_tflops``): arithmetic intensity
    (FLOP/byte), ridge point (GEMM rate / copy bandwidth), the bound (compute when the intensity is at
    or past the ridge, else memory), the attainable rate min(GEMM, intensity x bandwidth) and the
    fraction of it achieved. Without FLOPs only the bandwidth side is given."""
    bw = (ceilings or {}).get("copy_gbps")
    peak = (ceilings or {}).get("gemm_tflops")
    if not nbytes or not ms or not bw or not peak:
        return None
    sec = ms / 1e3
    out = {"achieved_gbps": nbytes / sec / 1e9, "copy_gbps": bw, "gemm_tflops": peak,
           "ridge_flop_per_byte": peak * 1e12 / (bw * 1e9), "ai_flop_per_byte": None, "bound": "memory",
           "achieved_tflops": None, "attainable_tflops": None, "fraction": nbytes / sec / 1e9 / bw}
    if flops:
        ai = flops / nbytes
        attainable = min(peak * 1e12, ai * bw * 1e9)
        achieved = flops / sec
        out.update(ai_flop_per_byte=ai, bound="compute" if ai >= out["ridge_flop_per_byte"] else "memory",
                   achieved_tflops=achieved / 1e12, attainable_tflops=attainable / 1e12, fraction=achieved / attainable)
    return out


def row_roofline(row: Dict, ceilings: Dict) -> Optional[Dict]:
    """:func:`roofline` of an ok row: its own FLOPs (attention: flash-attn's count, docs/PEERS.md) or, for the linear
    operators, :func:`linear_flops` (``flops_model`` says which)."""
    if row.get("status") != "ok":
        return None
    flops, model = row.get("flops"), "flash-attn"
    if not flops:
        flops = linear_flops(dict(row.get("case") or {}, op=row.get("op")), row.get("direction", "fwd"))
        model = "recurrence (lower bound)" if flops else None
    r = roofline(flops, row.get("bytes"), row.get("ms"), ceilings)
    if r is not None:
        r["flops_model"] = model
    return r


# ------------------------------------------------------------------------------------------ runner glue

MODES = ("auto", "off", "triton", "full")
NOT_COLLECTED = ("not collected (on by default in the kernels suite; `--resources` for every suite, with the "
                 "profiler's kernel names and times)")


class FirstCall:
    """What a row's untimed first call is watched with: the Triton launch capture (mode ``triton`` /
    ``full``) and, in mode ``full`` on a GPU, the PyTorch profiler (one session per phase, so that a
    backward row can leave out its forward)."""

    def __init__(self, mode: str, device, task=None, direction: str = "fwd", api=None):
        self.mode, self.device, self.task, self.direction = mode, device, task, direction
        self.triton = TritonLaunchCapture(device, api=api) if mode in ("triton", "full") else None
        self.profiled: Dict[str, ProfilerCapture] = {}
        self._prof: Optional[ProfilerCapture] = None
        self._phase = "fwd"
        self.stopped = False

    def _use_profiler(self) -> bool:
        return self.mode == "full" and getattr(self.device, "type", self.device) == "cuda"

    def __enter__(self) -> "FirstCall":
        if self.triton is not None:
            self.triton.__enter__()
        if self._use_profiler():
            self._prof = ProfilerCapture().__enter__()
        return self

    def mark(self, phase: str) -> None:
        """Launches from here on belong to ``phase`` (``"bwd"``: the backward of the first call)."""
        if self.stopped:
            return
        if self.triton is not None:
            self.triton.mark(phase)
        if self._prof is not None:
            self._prof.stop()
            self.profiled[self._phase] = self._prof
            self._prof = ProfilerCapture().__enter__()
        self._phase = phase

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.triton is not None:
            self.triton.stop()
        if self._prof is not None:
            self._prof.stop()
            self.profiled[self._phase] = self._prof
            self._prof = None

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def result(self, direction: str, limits_of: Callable[[], Dict]) -> Tuple[Optional[List[Dict]], str, Dict]:
        """(kernels, note, meta) for a row of ``direction``: a ``bwd`` row keeps the backward phase only."""
        keep = ("bwd",) if direction == "bwd" else ("fwd", "bwd")
        meta: Dict[str, Any] = {"mode": self.mode}
        notes: List[str] = []
        kernels: Optional[List[Dict]] = None
        if self.triton is not None:
            if self.triton.reason:
                notes.append(self.triton.reason)
            else:
                kernels = group_launches(k for k in self.triton.launches() if k["phase"] in keep)
                meta["triton"] = self.triton.version
                if self.triton.autotune_launches:
                    meta["autotune_launches"] = self.triton.autotune_launches
                    notes.append(f"{self.triton.autotune_launches} launches while triton.autotune benchmarked its "
                                 "candidates are not listed")
                if kernels:
                    limits = limits_of()
                    meta["limits"] = limits
                    add_occupancy(kernels, limits)
        prof = [(p, c) for p, c in self.profiled.items() if p in keep]
        if prof:
            seen = []
            for phase, c in prof:
                if c.reason:
                    notes.append(c.reason)
                for k in c.kernels or []:
                    seen.append(dict(k, phase=phase))
            meta["profiler"] = True
            if kernels is None:
                kernels = []
            # the profiler's device time joins our Triton records of the same name (per phase)
            by_name = {(k["phase"], k["kernel"]): k for k in seen}
            for k in kernels:
                p = by_name.pop((k["phase"], k["kernel"]), None)
                if p is not None:
                    k["device_us"] = p["device_us"]
                    k["profiled_launches"] = p["launches"]
            kernels += [k for k in seen if (k["phase"], k["kernel"]) in by_name]
        if kernels is not None and not kernels:
            notes.append("no Triton kernel was launched" + ("" if self.mode == "full" else
                         " (other kernels, e.g. cuDNN's or FlashAttention-2's, are named with --resources)"))
        return kernels, "; ".join(notes), meta


class RowResources:
    """The runner's side: ``first_call(task, direction)`` wraps the row's untimed first call;
    ``annotate(row)`` adds ``kernels``, ``kernels_note``, ``resources`` and ``roofline`` to every
    emitted row (JSON-serialisable)."""

    def __init__(self, settings, ceilings: Dict, device, api=None):
        self.mode = getattr(settings, "resources", "auto") or "auto"
        if self.mode not in MODES:
            raise ValueError(f"resources must be one of {MODES}, got {self.mode!r}")
        self.ceilings = ceilings
        self.device = device
        self.api = api
        self._last: Optional[FirstCall] = None
        self._limits: Optional[Dict] = None

    def mode_for(self, task) -> str:
        if self.mode == "auto":
            return "triton" if getattr(task, "suite", None) == "kernels" else "off"
        return self.mode

    def limits(self) -> Dict:
        if self._limits is None:
            self._limits = device_limits(self.device if getattr(self.device, "type", None) == "cuda" else None)
        return self._limits

    def first_call(self, task, direction: str) -> FirstCall:
        fc = FirstCall(self.mode_for(task), self.device, task, direction, api=self.api)
        self._last = fc
        return fc

    def _matches(self, fc: Optional[FirstCall], row: Dict) -> bool:
        if fc is None or fc.task is None:
            return False
        t = fc.task
        return (row.get("impl") == t.impl.name and row.get("direction") == fc.direction
                and row.get("op") == t.case.get("op") and row.get("suite") == t.suite)

    def annotate(self, row: Dict) -> Dict:
        try:
            fc, self._last = self._last, None
            kernels, note, meta = None, "", None
            if row.get("status") != "ok":
                note = f"the row did not run ({row.get('status')})"
            elif self._matches(fc, row):
                if fc.mode == "off":
                    note = NOT_COLLECTED
                else:
                    kernels, note, meta = fc.result(row["direction"], self.limits)
            elif self.mode == "off":
                note = NOT_COLLECTED
            else:
                note = NOT_COLLECTED if self.mode == "auto" and row.get("suite") != "kernels" else "no capture"
            row["kernels"], row["kernels_note"], row["resources"] = kernels, note, meta
            row["roofline"] = row_roofline(row, self.ceilings)
        except Exception as e:  # noqa: BLE001 - the report must never cost a row
            row.setdefault("kernels", None)
            row["kernels_note"] = f"resource report failed: {type(e).__name__}: {e}"
            row.setdefault("resources", None)
            row.setdefault("roofline", None)
        return row


# ------------------------------------------------------------------------------------------ report

# the suite's headline shape per operator (the roofline plot's points); absent labels fall back to the
# operator's first measured shape
HEADLINE = {"flash": "B=8 S=4096 H=16 D=128 causal", "kda": "B=8 S=4096 H=16 D=128",
            "diag": "B=8 S=4096 H=16 D=128", "kda_decode": "B=64 H=16 D=128", "diag_decode": "B=64 H=16 D=128",
            "flash_decode": "B=64 ctx=8192 H=16 D=128"}
_OPS = ("flash", "flash_varlen", "kda", "diag", "flash_decode", "kda_decode", "diag_decode")


def _n(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "-"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    return f"{x:,}" if isinstance(x, int) and abs(x) >= 10000 else str(x)


def _kib(b) -> str:
    if b is None:
        return "-"
    return f"{b / 1024:.1f} KiB" if b >= 1024 else f"{b} B"


def _cell(s: str) -> str:
    return str(s).replace("|", "/").replace("\n", " ")


def _short(name: Optional[str], n: int = 70) -> str:
    name = name or "?"
    return name if len(name) <= n else name[: n - 1] + "…"


def config_text(k: Dict) -> str:
    c = k.get("config") or {}
    if not c:
        return "-"
    parts = [f"{n}={v}" for n, v in (c.get("constexprs") or {}).items()]
    parts.append(f"warps={c.get('num_warps')}")
    parts.append(f"stages={c.get('num_stages')}")
    if (c.get("num_ctas") or 1) > 1:
        parts.append(f"ctas={c['num_ctas']}")
    if c.get("maxnreg"):
        parts.append(f"maxnreg={c['maxnreg']}")
    return " ".join(parts)


def _table(header: List[str], lines: Iterable[List[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(_cell(c) for c in line) + " |" for line in lines]
    return "\n".join(out)


def _roofline_of(row: Dict, ceilings: Dict) -> Optional[Dict]:
    return row.get("roofline") if row.get("roofline") is not None else row_roofline(row, ceilings)


def kernel_lines(row: Dict, limits_sms: Optional[int] = None) -> List[List[str]]:
    lines = []
    for k in row.get("kernels") or []:
        occ = k.get("occupancy") or {}
        grid = k.get("grid")
        progs = k.get("programs")
        sms = limits_sms
        grid_txt = "-" if grid is None else ("×".join(str(g) for g in grid if g != 1) or "1")
        if progs is not None and sms:
            grid_txt += f" ({progs / sms:.2f}× SMs)" if progs != 1 else ""
        lines.append([row["impl"], row["label"], row["direction"], k.get("phase", ""),
                      "`" + _short(k.get("kernel")) + "`",
                      config_text(k), _n(k.get("regs")), _n(k.get("spills")), _kib(k.get("shared")), grid_txt,
                      _n(occ.get("programs_per_sm")), occ.get("binding") or "-", _n(occ.get("waves")),
                      _n(k.get("launches")), _n(k.get("device_us"))])
    return lines


def wanted(run: Optional[Dict], rows: List[Dict]) -> bool:
    """Whether report.md gets the resource section and roofline.png: any row has kernels, or the suite
    is the kernels suite."""
    return (run or {}).get("suite") == "kernels" or any(r.get("kernels") for r in rows)


def resources_section(rows: List[Dict], run: Optional[Dict] = None) -> str:
    """Markdown for report.md: per operator, one table of the kernels of every row; one roofline table;
    for rows without kernel figures, why. Empty when the run collected nothing and is not the
    kernels suite."""
    run = run or {}
    have = [r for r in rows if r.get("kernels")]
    if not wanted(run, rows):
        return ""
    ceilings = run.get("ceilings") or {}
    out = ["## Kernel resources and roofline", ""]
    limits = next((r["resources"]["limits"] for r in have if (r.get("resources") or {}).get("limits")), None)
    sms = limits.get("sm_count") if limits else None
    if limits:
        out += [f"Device limits, from {limits.get('source')}: {limits.get('sm_count')} SMs; per SM "
                f"{limits.get('regs_per_sm'):,} registers (per warp in units of {limits.get('reg_alloc_unit')}, "
                f"{limits.get('reg_subpartitions')} sub-partitions, ≤ {limits.get('max_regs_per_thread')} per "
                f"thread), "
                f"{_kib(limits.get('smem_per_sm'))} shared memory (≤ {_kib(limits.get('smem_per_block_optin'))} per "
                f"block + {_kib(limits.get('smem_reserved_per_block'))} reserved), {limits.get('max_threads_per_sm')} "
                f"threads, {limits.get('max_blocks_per_sm')} blocks.", ""]
    out += ["Each Triton kernel launched by a row's untimed first call (no extra run), read from the compiled kernel "
            "at launch: config (constexpr tile sizes, warps, pipeline stages), registers per thread, spills (local "
            "memory per thread in 4-byte words, as Triton reports it), shared memory per program, grid (programs, "
            "and as a multiple of the SM count), resident programs per SM and the limit that binds it (CUDA's "
            "occupancy calculator: registers, shared memory, threads, blocks), waves = programs / (SMs × resident). "
            "A `bwd` row lists its backward's kernels only. Device µs: the PyTorch profiler's time of that kernel "
            "in the first call (`--resources`); kernels other than Triton's (cuDNN, FlashAttention-2) appear "
            "there by name only: their resource figures cannot be read.", ""]
    hdr = ["implementation", "case", "dir", "phase", "kernel", "config", "regs", "spills", "smem", "grid",
           "programs/SM", "bound by", "waves", "launches", "device µs"]
    by_op: "OrderedDict[str, List[Dict]]" = OrderedDict()
    for r in sorted(have, key=lambda r: _OPS.index(r["op"]) if r["op"] in _OPS else 99):
        by_op.setdefault(r["op"], []).append(r)
    for op, rs in by_op.items():
        lines = [line for r in rs for line in kernel_lines(r, sms)]
        out += [f"<details><summary><b>{op}</b>: {len(rs)} rows, {len(lines)} kernel entries</summary>", "",
                _table(hdr, lines), "", "</details>", ""]
    # rows without figures, grouped by reason
    why: Dict[str, List[str]] = defaultdict(list)
    for r in rows:
        if not r.get("kernels") and r.get("status") == "ok":
            why[r.get("kernels_note") or "no kernel figures recorded (a results file from before the resource "
                                           "report)"].append(f"{r['impl']} {r['label']} {r['direction']}")
    if why:
        out += ["**No kernel figures in this run.** Why:" if not have else "Rows without kernel figures:", ""]
        for note, where in why.items():
            shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
            out.append(f"- {note} ({len(where)} rows: {shown})")
        out.append("")
    # roofline table
    lines = []
    for r in sorted(rows, key=lambda r: _OPS.index(r["op"]) if r.get("op") in _OPS else 99):
        rl = _roofline_of(r, ceilings)
        if rl is None:
            continue
        ach = (f"{_n(rl['achieved_tflops'])} TFLOP/s, " if rl.get("achieved_tflops") is not None else "") + \
            f"{_n(rl['achieved_gbps'])} GB/s"
        att = f"{_n(rl['attainable_tflops'])} TFLOP/s" if rl.get("attainable_tflops") is not None else \
            f"{_n(rl['copy_gbps'])} GB/s"
        lines.append([r["op"], r["impl"], r["label"], r["dtype"], r["direction"],
                      rl.get("flops_model") or "none (bytes only)",
                      _n(rl.get("ai_flop_per_byte")), rl["bound"], ach, att, f"{100 * rl['fraction']:.0f}%"])
    if lines:
        ridge = next((_roofline_of(r, ceilings) for r in rows if _roofline_of(r, ceilings)), None)
        out += ["### Roofline", "",
                f"Ceilings of this run: copy {_n(ceilings.get('copy_gbps'))} GB/s, GEMM "
                f"{_n(ceilings.get('gemm_tflops'))} TFLOP/s: ridge point {_n(ridge['ridge_flop_per_byte'])} FLOP/byte. "
                "Intensity = FLOPs / bytes (the rows' byte model); bound = compute at or past the ridge, else "
                "memory; attainable = min(GEMM rate, intensity × copy bandwidth); fraction = achieved / "
                "attainable (for a memory-side point that is the fraction of the copy bandwidth, whatever the "
                "FLOP count). FLOPs: flash-attn's count for attention (docs/PEERS.md); for KDA and the diagonal "
                "recurrence a lower bound from the recurrent form (KDA 7·D²+2·D, diagonal 4·D per token and head; "
                "backward 2x).", "",
                _table(["operator", "implementation", "case", "dtype", "dir", "FLOP model", "FLOP/byte", "bound",
                        "achieved", "attainable", "of attainable"], lines), ""]
    return "\n".join(out)


def headline_rows(rows: List[Dict]) -> List[Dict]:
    """One ok row per (operator, implementation, direction) at the operator's headline shape (first
    dtype of the run), each with a roofline point (FLOPs known or bounded)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return []
    dtype = ok[0]["dtype"]
    out = []
    for op in OrderedDict.fromkeys(r["op"] for r in ok):
        rs = [r for r in ok if r["op"] == op and r["dtype"] == dtype]
        labels = [r["label"] for r in rs]
        want = HEADLINE.get(op)
        label = want if want in labels else (labels[0] if labels else None)
        seen = set()
        for r in rs:
            key = (r["impl"], r["direction"])
            if r["label"] == label and key not in seen:
                seen.add(key)
                out.append(r)
    return out


def roofline_plot(out_dir: str, run: Dict, rows: List[Dict], name: str = "roofline.png") -> Optional[str]:
    """A log-log roofline PNG: the memory roof (intensity × copy bandwidth) and the compute roof (GEMM
    rate) of the run's ceilings, one point per operator and implementation at the suite's headline
    shape, one panel per direction. Returns its path, or None (no ceilings, no point, no matplotlib)."""
    ceilings = run.get("ceilings") or {}
    if not ceilings.get("copy_gbps") or not ceilings.get("gemm_tflops"):
        return None
    pts = []
    for r in headline_rows(rows):
        rl = _roofline_of(r, ceilings)
        if rl and rl.get("ai_flop_per_byte") and rl.get("achieved_tflops"):
            pts.append((r, rl))
    if not pts:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    dirs = [d for d in ("fwd", "bwd", "fwd+bwd") if any(r["direction"] == d for r, _ in pts)]
    dirs += sorted({r["direction"] for r, _ in pts} - set(dirs))
    bw, peak = ceilings["copy_gbps"] * 1e9, ceilings["gemm_tflops"] * 1e12
    ridge = peak / bw
    ais = [rl["ai_flop_per_byte"] for _, rl in pts]
    lo, hi = min(min(ais), ridge) / 8, max(max(ais), ridge) * 8
    colors = {op: f"C{i}" for i, op in enumerate(_OPS)}
    fig, axes = plt.subplots(1, len(dirs), figsize=(6.5 * len(dirs), 5.2), squeeze=False)
    dev = ((run.get("env") or {}).get("gpu") or {}).get("name") or "CPU"
    for ax, d in zip(axes[0], dirs):
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(peak, x * bw) / 1e12 for x in xs], "k-", lw=1.2)
        ax.axvline(ridge, color="k", lw=0.6, ls=":")
        ax.text(ridge, lo * bw / 1e12, f" ridge {ridge:.0f} FLOP/B", fontsize=7, va="bottom", rotation=90)
        ax.text(lo, lo * bw / 1e12, f" copy {ceilings['copy_gbps']:.0f} GB/s", fontsize=7, va="bottom", rotation=0)
        ax.text(hi, peak / 1e12, f"GEMM {ceilings['gemm_tflops']:.0f} TFLOP/s ", fontsize=7, va="bottom", ha="right")
        for r, rl in pts:
            if r["direction"] != d:
                continue
            ours = r.get("provider") == "delta-attn"
            ax.scatter([rl["ai_flop_per_byte"]], [rl["achieved_tflops"]], color=colors.get(r["op"], "k"),
                       marker="o" if ours else "^", s=36, edgecolors="k" if ours else "none",
                       label=f"{r['op']}: {r['impl']}")
            ax.annotate(r["impl"].replace("delta-attn ", "ours "), (rl["ai_flop_per_byte"], rl["achieved_tflops"]),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte)")
        ax.set_ylabel("achieved TFLOP/s")
        ax.set_title(d, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(handles, labels, fontsize=6, loc="lower right")
    fig.suptitle(f"{run.get('suite', '')}: roofline at the headline shapes ({dev}; circles: delta-attn, triangles: "
                 "peers; KDA / diagonal FLOPs are a lower bound)", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
