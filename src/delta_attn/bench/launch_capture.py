"""What a bench row's untimed first call launched: every Triton kernel with its configuration,
registers, spills, shared memory and grid (:class:`TritonLaunchCapture`), and the device kernels of any
library by name and device time through the PyTorch profiler (:class:`ProfilerCapture`); :class:`FirstCall`
runs both around the call.

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
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .. import settings
from .occupancy import add_occupancy


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


# ------------------------------------------------------------------------------------------ a row's first call

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
