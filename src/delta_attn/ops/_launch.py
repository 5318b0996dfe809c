"""The launch layer shared by the Triton launchers: tile configs fitted to the device.

A launcher gives :func:`launch` its kernel, arguments and an ordered list of :class:`Tiles`
candidates (the tuned one first, smaller ones after). On a GPU the first candidate whose compiled
kernel fits the device's shared memory is launched, so an accepted call never fails with Triton's
``OutOfResources``; the choice is cached per specialisation (kernel, constexprs, dtypes, device), so
a call pays one dictionary look-up after the first. Under the CPU interpreter there is no limit:
the first candidate runs.

:func:`compiled_together` batches a pipeline's launches: on a GPU the kernels not compiled yet compile
concurrently (one thread each: Triton's compiler, ptxas and the C compiler of its launcher stubs release the
GIL for most of their time), then every launch runs in order, so a pipeline's first call costs its slowest
kernel's compile, not the sum. Inside it, :func:`compile_only` records launches that are compiled with the
others but never run (a training forward compiles its backward's kernels that way).

Every launcher prepares what its kernels receive with the helpers of :mod:`._prepare`, re-exported
here: :func:`index` (contiguous int32 index tensors), :func:`param` (contiguous operands and
parameters), :func:`unit_last`, :func:`optional` (a cached placeholder pointer for an absent input),
and the device's limits (:func:`sm_count`, :func:`shared_memory`). Importing this module applies the
Triton interpreter's fixes (:mod:`._triton_interpreter`, only while ``TRITON_INTERPRET`` is on): every
launcher imports it before its first launch.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import _triton_interpreter
from ._prepare import index, optional, param, shared_memory, sm_count, unit_last

_triton_interpreter.patch()

__all__ = ["Tiles", "tiles", "halving", "fit", "launch", "index", "param", "unit_last", "optional", "sm_count",
           "shared_memory", "eager_or_op", "cdiv", "next_pow2", "compiled_together",
           "compile_only", "compile_device", "compile_configs"]


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain Python (Triton's is a constexpr function: ~2 us per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` in plain Python for n >= 0 (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def eager_or_op(fn: Callable, op: Callable, like: Optional[torch.Tensor] = None) -> Callable:
    """The one eager fast path of every op: ``fn`` (a custom op's own body) in eager mode, the custom op ``op``
    while torch.compile traces (Dynamo, or AOTAutograd tracing an autograd Function on fake or functional
    tensors: ``like``, one of the call's tensors, is then not a plain tensor). Both run the same launcher. The
    eager path skips the custom op's dispatch, ~10-20 us of host time per call (more than a decode step's
    kernel takes on the GPU), and its first call's import of torch._dynamo (about 1-4 s of a cold start)."""
    traced = like is not None and type(like) not in (torch.Tensor, torch.nn.Parameter)
    return op if traced or torch.compiler.is_compiling() else fn


@dataclass(frozen=True)
class Tiles:
    """One launch configuration: tile constexprs, warps, pipeline stages, and why it is chosen."""
    meta: Tuple[Tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 1
    reason: str = ""

    @functools.cached_property
    def kwargs(self) -> Dict[str, int]:
        """The tile constexprs as keyword arguments (built once per Tiles; read-only by convention)."""
        return dict(self.meta)

    def get(self, name: str) -> int:
        return self.kwargs[name]

    def with_(self, reason: str = "", num_stages=None, **meta) -> "Tiles":
        """A copy with some tile sizes (or the stage count) replaced."""
        m = dict(self.meta)
        m.update(meta)
        return Tiles(tuple(sorted(m.items())), self.num_warps,
                     self.num_stages if num_stages is None else num_stages, reason or self.reason)


def tiles(reason: str, num_warps: int = 4, num_stages: int = 1, **meta) -> Tiles:
    return Tiles(tuple(sorted(meta.items())), num_warps, num_stages, reason)


@functools.lru_cache(maxsize=1024)
def halving(first: Tiles, names: Tuple[str, ...], floor: int = 16) -> Tuple[Tiles, ...]:
    """``first``, then single-stage copies with each named tile halved in turn down to ``floor``:
    the fallbacks of :func:`launch` when ``first`` needs more shared memory than the device has.
    Cached (a pure function of its arguments): launchers call it on every launch."""
    out = [first]
    cur = first.with_(num_stages=1)
    if cur != first:
        out.append(cur)
    for _ in range(8):
        changed = False
        for n in names:
            v = cur.get(n)
            if v // 2 >= floor:
                cur = cur.with_(reason=f"fits shared memory: {n} {v // 2}", **{n: v // 2})
                out.append(cur)
                changed = True
        if not changed:
            break
    return tuple(out)


_FITTED: Dict[tuple, Tiles] = {}


def _fitted_key(kernel, args, fixed: dict, candidates: Sequence[Tiles], device_index) -> tuple:
    """The specialisation whose fitted tiles :func:`launch` caches: kernel; per argument what Triton compiles a
    separate kernel for (a tensor's dtype and whether its address is 16-byte aligned, an int's being 1 or a
    multiple of 16, another scalar's type: the same tiles can need more shared memory in one specialisation than
    in another, so each is fitted on its own); constexprs, device and candidates. One pass over the arguments, on
    every launch."""
    spec = tuple((a.dtype, not a.data_ptr() & 15) if isinstance(a, torch.Tensor)
                 else (a == 1, not a & 15) if type(a) is int else type(a) for a in args)
    return (kernel, spec, tuple(sorted(fixed.items())), device_index, tuple(candidates))


def fit(kernel, grid: Callable[[Tiles], tuple], args: tuple, fixed: dict, candidates: Sequence[Tiles],
        limit: int) -> Tiles:
    """The first candidate whose compiled kernel (``kernel.warmup``: compiled, not launched) needs at most
    ``limit`` bytes of shared memory; a RuntimeError naming every candidate's need when none does."""
    needs = []
    for t in candidates:
        compiled = kernel.warmup(*args, grid=grid(t), **fixed, **dict(t.meta), num_warps=t.num_warps,
                                 num_stages=t.num_stages)
        needs.append(int(compiled.metadata.shared))
        if needs[-1] <= limit:
            compiled._init_handles()       # loads the binary and builds the launcher stub now (not at first run)
            return t
    name = getattr(kernel, "__name__", None) or kernel.fn.__name__
    raise RuntimeError(f"{name}: no tile configuration fits the device's {limit} bytes of shared memory "
                       f"(needed {needs} for {[dict(t.meta) for t in candidates]})")


@dataclass(frozen=True)
class _Launch:
    """One recorded launch: what :func:`launch` received."""
    kernel: object
    grid: Callable[[Tiles], tuple]
    args: tuple
    fixed: dict
    candidates: Tuple[Tiles, ...]
    device: torch.device
    run: bool = True

    @functools.cached_property
    def key(self) -> tuple:
        """The specialisation of :func:`_fitted_key` (formed once: the batch and the launch both look it up)."""
        return _fitted_key(self.kernel, self.args, self.fixed, self.candidates, self.device.index)


class _Batch(threading.local):
    pending: Optional[List[Union[_Launch, Callable[[], None]]]] = None
    compile_for: Optional[torch.device] = None      # inside compile_only: the device the launches compile for


_BATCH = _Batch()


@contextlib.contextmanager
def compiled_together():
    """Launches inside the block are recorded; at its end the kernels not compiled yet compile concurrently
    (GPU), then every launch runs in the order it was made. The block may only allocate between launches
    (nothing in it may read what a launch writes). A nested block joins the outer one."""
    if _BATCH.pending is not None:
        yield
        return
    _BATCH.pending = []
    try:
        yield
        pending = _BATCH.pending
    finally:
        _BATCH.pending = None
    _fit_concurrently([p for p in pending if isinstance(p, _Launch) and p.device.type == "cuda"])
    for p in pending:
        if not isinstance(p, _Launch):
            p()                     # a host step (in_launch_order)
        elif p.run:
            _run(p)


@contextlib.contextmanager
def compile_only(device: torch.device):
    """Inside :func:`compiled_together`: the launches of the block (made on meta tensors of the right dtypes,
    so nothing is allocated) are compiled for ``device`` with the batch and never run. Nothing is compiled for
    a device other than CUDA."""
    if _BATCH.pending is None:
        raise RuntimeError("compile_only() is only meaningful inside compiled_together()")
    outer = _BATCH.compile_for
    _BATCH.compile_for = device
    try:
        yield
    finally:
        _BATCH.compile_for = outer


def compile_device(device: torch.device) -> torch.device:
    """The device a launch made on tensors of ``device`` is for: inside :func:`compile_only`, meta tensors stand for
    the device the block compiles for (a dispatch that depends on the device then picks what the real call runs)."""
    if device.type == "meta" and _BATCH.compile_for is not None:
        return _BATCH.compile_for
    return device


def _fit_one(p: _Launch) -> None:
    with torch.cuda.device(p.device):
        _FITTED[p.key] = fit(p.kernel, p.grid, p.args, p.fixed, p.candidates, shared_memory(p.device))


def _fit_concurrently(launches: Sequence[_Launch]) -> None:
    """Fit (compile) every launch whose specialisation is not fitted yet, one thread per kernel."""
    todo = list({p.key: p for p in launches if p.key not in _FITTED}.values())
    for kernel, device in dict.fromkeys((p.kernel, p.device) for p in todo):
        _prime_jit(kernel, device)
    if len(todo) <= 1:
        for p in todo:
            _fit_one(p)
        return
    _in_threads(_fit_one, todo)


def compile_configs(jobs: Sequence[Tuple[object, tuple, dict, Sequence]]) -> None:
    """Compile, concurrently (one thread per configuration), every ``triton.Config`` of each job
    ``(jit kernel, args, kwargs, configs)``: ``kernel.warmup`` with the arguments of the coming launch, so an
    autotuner that then benchmarks the configurations one after another finds each compiled (its first call of
    a new key costs the slowest compile, not the sum)."""
    work = [(kernel, args, kwargs, c) for kernel, args, kwargs, configs in jobs for c in configs]
    if not work:
        return
    device = next(a.device for a in work[0][1] if isinstance(a, torch.Tensor))
    for kernel in dict.fromkeys(w[0] for w in work):
        _prime_jit(kernel, device)

    def one(w):
        kernel, args, kwargs, c = w
        try:
            with torch.cuda.device(device):
                kernel.warmup(*args, grid=(1,), **kwargs, **c.kwargs, num_warps=c.num_warps,
                              num_stages=c.num_stages)._init_handles()
        except Exception:  # noqa: BLE001  (a configuration that does not build fails again, and is reported,
            pass           # where the autotuner compiles it)

    _in_threads(one, work)


def _in_threads(fn: Callable, items: Sequence) -> None:
    """``fn(item)`` for every item, one thread each (at most one per CPU); the first error is raised."""
    with ThreadPoolExecutor(max_workers=min(len(items), os.cpu_count() or 1)) as pool:
        for f in [pool.submit(fn, x) for x in items]:
            f.result()


def _prime_jit(kernel, device: torch.device) -> None:
    """Create a JIT kernel's per-device state (Triton's ``device_caches``, a defaultdict filled on first use) in
    the calling thread: threads compiling variants of the same kernel would otherwise each create one, and the
    kernels compiled into all but the last would be lost (compiled again at their launch)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        with torch.cuda.device(device):
            _ = caches[torch.cuda.current_device()]      # the look-up creates it


def _run(p: _Launch) -> Tiles:
    chosen = p.candidates[0]
    if p.device.type == "cuda":
        key = p.key
        chosen = _FITTED.get(key)
        if chosen is None:
            chosen = _FITTED[key] = fit(p.kernel, p.grid, p.args, p.fixed, p.candidates, shared_memory(p.device))
    p.kernel[p.grid(chosen)](*p.args, **p.fixed, **chosen.kwargs, num_warps=chosen.num_warps,
                             num_stages=chosen.num_stages)
    return chosen


def in_launch_order(step: Callable[[], None]) -> None:
    """``step()`` where a launch made now would run: at once outside :func:`compiled_together`, else at the block's
    end between the launches made before and after it (work it enqueues on the stream lands between theirs); never
    inside :func:`compile_only`, where nothing runs."""
    if _BATCH.compile_for is not None:
        return
    if _BATCH.pending is not None:
        _BATCH.pending.append(step)
    else:
        step()


def launch(kernel, grid: Callable[[Tiles], tuple], args: tuple, fixed: dict,
           candidates: Sequence[Tiles]) -> Optional[Tiles]:
    """Launch ``kernel[grid(t)](*args, **fixed, **t.meta)`` with the first candidate ``t`` that fits the
    device's shared memory (GPU; :func:`fit`, cached per specialisation), or the first candidate (CPU
    interpreter). Returns the tiles used; None inside :func:`compiled_together` (the launch runs at the
    block's end)."""
    if _BATCH.compile_for is not None:
        _BATCH.pending.append(_Launch(kernel, grid, args, fixed, tuple(candidates), _BATCH.compile_for, run=False))
        return None
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    p = _Launch(kernel, grid, args, fixed, tuple(candidates), device)
    if _BATCH.pending is not None:
        _BATCH.pending.append(p)
        return None
    return _run(p)
