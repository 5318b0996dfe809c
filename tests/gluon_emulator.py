"""A CPU emulator for the Gluon kernels: each program runs the kernel's Python body sequentially on torch tensors,
with every ``gl`` / Hopper / Ampere builtin the kernels use replaced by an eager equivalent.

What it checks beyond the results (each a :class:`GluonHazard`, raised where it happens):

- global memory: a load or store outside its tensor (masked-off lanes excepted);
- cp.async: a read of shared memory whose copy has not landed (``wait_group``), a copy into memory still being
  read by an outstanding asynchronous wgmma or read by other threads since the last ``thread_barrier``;
- shared memory across threads: a read of what was written since the last ``thread_barrier`` (the stores of other
  threads need it: a kernel's shared-memory round trips change layout), a store over what was read since it;
- wgmma: a shared operand written since the last ``fence_async_shared`` or barrier, a store over an operand of
  an outstanding asynchronous wgmma, an asynchronous result used before ``warpgroup_mma_wait`` retires it;
- uninitialised shared memory reads as NaN.

Numerics follow the hardware where it matters to the error rule: bf16 operands multiply exactly into fp32
accumulators; fp32 operands of wgmma / mma_v2 are truncated to tf32; ``ex2.approx.ftz`` flushes subnormal
results; Triton's type promotion (a scalar tensor promotes a block like any tensor) and its NaN-ignoring max.
Layouts are not modelled: a sequential program cannot show a race inside one barrier interval, so the hazards
above are the ordering rules the kernels follow, checked conservatively.

Warp specialisation (``gl.warp_specialize``): each partition runs in its own thread with its own cp.async groups and
wgmmas, one partition at a time, switching only where one waits on an mbarrier whose phase has not completed (a
deterministic interleaving); every partition blocked is a deadlock (a :class:`GluonHazard`). mbarriers count
arrivals and complete phases as the hardware does (a fresh barrier's wait on parity 1 passes). A store over shared
memory that any partition's outstanding wgmma reads is a hazard.

Usage: ``with emulated_gluon(): ...`` runs every Gluon launch made inside on the emulator (CPU tensors).
"""
from __future__ import annotations

import contextlib
import types
from typing import List, Optional

import torch

__all__ = ["GluonHazard", "emulated_gluon", "run_kernel"]


class GluonHazard(AssertionError):
    """An ordering or bounds rule of the GPU that the emulated program broke."""


# ---------------------------------------------------------------------------------------------------------------
# tensors with Triton's promotion


def _wrap(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, GT):
        return x.as_subclass(GT)
    return x


class GT(torch.Tensor):
    """A register tensor: torch semantics except that tensors of any rank promote each other (Triton's rule; torch
    lets a 0-d tensor take the dtype of a block), integer // and % truncate (C), and max / min ignore NaN."""

    _lay = None         # the layout the kernel gave it (tracked where Gluon fixes it; None: unknown)

    def to(self, *args, bitcast=False, fp_downcast_rounding=None, **kwargs):
        """Triton's cast: ``bitcast`` reinterprets the bits."""
        if bitcast:
            return _tagged(_plain(self).view(args[0]), self._lay)
        return super().to(*args, **kwargs)

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        res = cls._dispatch(func, types_, args, kwargs or {})
        if isinstance(res, GT):
            res._lay = _result_layout(func, args, res)
        return res

    @classmethod
    def _dispatch(cls, func, types_, args, kwargs):
        if func in _BINARY and len(args) >= 2:
            a, b = args[0], args[1]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype != b.dtype:
                dt = torch.promote_types(a.dtype, b.dtype)
                args = (a.to(dt), b.to(dt)) + tuple(args[2:])
            if func in _INT_DIV:
                x, y = args[0], args[1]
                xd = x.dtype if isinstance(x, torch.Tensor) else None
                if xd is not None and not xd.is_floating_point and not isinstance(y, float):
                    fn = torch.div if func is _INT_DIV[0] else torch.fmod
                    kw = {"rounding_mode": "trunc"} if fn is torch.div else {}
                    with torch._C.DisableTorchFunctionSubclass():
                        return _wrap(fn(x, y, **kw))
            if func in _RINT_DIV:
                y, x = args[0], args[1]     # reflected: x // y with x a Python scalar
                if isinstance(y, torch.Tensor) and not y.dtype.is_floating_point and isinstance(x, int):
                    fn = torch.div if func is _RINT_DIV[0] else torch.fmod
                    kw = {"rounding_mode": "trunc"} if fn is torch.div else {}
                    with torch._C.DisableTorchFunctionSubclass():
                        return _wrap(fn(torch.full_like(y, x), y, **kw))
        return super().__torch_function__(func, types_, args, kwargs)


def _result_layout(func, args, res):
    """Gluon's layout of an op's result: a SliceLayout's parent where x[:, None] / x[None, :] re-adds the sliced
    dimension, else the one layout among the operands of the result's rank (Gluon broadcasts within a layout)."""
    if func is torch.Tensor.__getitem__:
        x, idx = args[0], args[1]
        lay = getattr(x, "_lay", None)
        if lay is not None and lay.kind == "SliceLayout" and x.dim() == 1 and isinstance(idx, tuple) and None in idx:
            dim, parent = lay.slice_args()
            return parent if idx.index(None) == dim else None
        return None
    flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else (x,))]
    tags = {a._lay for a in flat if isinstance(a, GT) and a._lay is not None and a.dim() == res.dim()}
    return tags.pop() if len(tags) == 1 else None


def _tagged(x, layout):
    """x (a new view) with layout ``layout``."""
    y = _plain(_t(x)).view_as(_plain(_t(x))).as_subclass(GT)
    y._lay = layout
    return y


def _lay(x):
    return getattr(x, "_lay", None)


_T = torch.Tensor
_INT_DIV = (_T.__floordiv__, _T.__mod__)
_RINT_DIV = (_T.__rfloordiv__, _T.__rmod__)
_BINARY = {
    _T.__add__, _T.__radd__, _T.__sub__, _T.__rsub__, _T.__mul__, _T.__rmul__, _T.__truediv__, _T.__rtruediv__,
    _T.__floordiv__, _T.__rfloordiv__, _T.__mod__, _T.__rmod__, _T.__and__, _T.__rand__, _T.__or__, _T.__ror__,
    _T.__xor__, _T.__rxor__, _T.__lt__, _T.__le__, _T.__gt__, _T.__ge__, _T.__eq__, _T.__ne__, _T.__lshift__,
    _T.__rshift__, torch.fmax, torch.fmin, torch.add, torch.mul, torch.sub,
}


def _t(x, dtype=None) -> GT:
    """A Python scalar or tensor as a register tensor (Python ints int32, floats fp32, bools int1)."""
    if isinstance(x, torch.Tensor):
        return _wrap(x if dtype is None else x.to(dtype))
    if dtype is None:
        dtype = torch.bool if isinstance(x, bool) else torch.int32 if isinstance(x, int) else torch.float32
    return torch.tensor(x, dtype=dtype).as_subclass(GT)


def _plain(x):
    return x.as_subclass(torch.Tensor) if isinstance(x, GT) else x


# ---------------------------------------------------------------------------------------------------------------
# global memory


class _PtrType:
    def __init__(self, element_ty):
        self.element_ty = element_ty


class Ptr:
    """A pointer (or block of pointers) into one tensor's storage: the storage as a flat view and element
    offsets from the tensor's first element."""

    def __init__(self, flat: torch.Tensor, off, name: str):
        self.flat, self.off, self.name = flat, off, name

    @property
    def dtype(self):
        return _PtrType(self.flat.dtype)

    def __add__(self, o):
        if isinstance(o, Ptr):
            raise TypeError("pointer + pointer")
        return Ptr(self.flat, self.off + o, self.name)

    __radd__ = __add__

    def __sub__(self, o):
        return Ptr(self.flat, self.off - o, self.name)

    def offsets(self) -> torch.Tensor:
        return _plain(torch.as_tensor(self.off)).to(torch.int64)


def _ptr_of(t: torch.Tensor, name: str) -> Ptr:
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    flat = torch.as_strided(t, (n,), (1,), t.storage_offset())
    return Ptr(flat, 0, name)


def _checked(ptr: Ptr, mask, what: str):
    off = ptr.offsets()
    if mask is not None:
        mask = _plain(torch.as_tensor(mask)).to(torch.bool)
        off, mask = torch.broadcast_tensors(off, mask)
    live = off if mask is None else off[mask]
    if live.numel() and (int(live.min()) < 0 or int(live.max()) >= ptr.flat.numel()):
        raise GluonHazard(f"{what} out of bounds of '{ptr.name}': offsets {int(live.min())}..{int(live.max())}, "
                          f"{ptr.flat.numel()} elements")
    safe = off if mask is None else torch.where(mask, off, 0)
    return safe, mask


def load(ptr, mask=None, other=None, **_):
    safe, mask = _checked(ptr, mask, "load")
    val = ptr.flat[safe]
    if mask is not None:
        val = torch.where(mask, val, torch.tensor(0 if other is None else _plain(other), dtype=val.dtype))
    return _tagged(val.clone(), _lay(ptr.off))


def store(ptr, value, mask=None, **_):
    safe, mask = _checked(ptr, mask, "store")
    value = _plain(torch.as_tensor(_plain(value))).to(ptr.flat.dtype)
    value = torch.broadcast_to(value, safe.shape)
    if mask is None:
        ptr.flat[safe.reshape(-1)] = value.reshape(-1)
    else:
        ptr.flat[safe[mask]] = value[mask]


# ---------------------------------------------------------------------------------------------------------------
# shared memory and its ordering state


class _Machine:
    """The program's (or a partition's) asynchronous state: cp.async groups and outstanding asynchronous wgmmas;
    the shared-memory allocations (shared by a program's partitions), the machines of its partitions."""

    def __init__(self, allocs=None, partitions=None):
        self.open_group: List[tuple] = []
        self.groups: List[List[tuple]] = []
        self.wgmmas: List["AsyncAcc"] = []
        self.allocs: List["Smem"] = [] if allocs is None else allocs
        self.partitions: List["_Machine"] = [self] if partitions is None else partitions

    def check_end(self, what: str):
        if self.groups or self.open_group:
            raise GluonHazard(f"{what} ended with cp.async groups not waited for")
        if self.wgmmas:
            raise GluonHazard(f"{what} ended with asynchronous wgmmas not waited for")


_M: Optional[_Machine] = None
_ACCESS: dict = {}


class Smem:
    """A shared-memory descriptor: a view of the allocation's data and, alike, of its per-element state:
    pending (a cp.async in flight), written / read since the last barrier, unfenced (generic writes the async
    proxy does not see yet)."""

    def __init__(self, data, pending, written, read, unfenced, written_by, read_by):
        self.data, self.pending, self.written, self.read, self.unfenced = data, pending, written, read, unfenced
        self.written_by, self.read_by = written_by, read_by

    def _map(self, f) -> "Smem":
        return Smem(*(f(x) for x in (self.data, self.pending, self.written, self.read, self.unfenced,
                                     self.written_by, self.read_by)))

    def access(self, layout) -> int:
        """The id of an access of this view in ``layout`` (the same id: the same threads hold the same elements);
        0 when the layout is unknown."""
        if layout is None:
            return 0
        key = (layout.key() if isinstance(layout, _Layout) else layout, tuple(self.data.shape), self.data.stride(),
               self.data.storage_offset())
        return _ACCESS.setdefault(key, len(_ACCESS) + 1)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def shape(self):
        return list(self.data.shape)

    def index(self, i):
        i = int(i)
        if not 0 <= i < self.data.shape[0]:
            raise GluonHazard(f"shared memory index {i} outside [0, {self.data.shape[0]})")
        return self._map(lambda x: x[i])

    def slice(self, start, length, dim=0):
        start, length = int(start), int(length)
        if start < 0 or start + length > self.data.shape[dim]:
            raise GluonHazard(f"shared memory slice {start}+{length} outside dim {dim} of {self.shape}")
        return self._map(lambda x: x.narrow(dim, start, length))

    def permute(self, order):
        return self._map(lambda x: x.permute(*[int(o) for o in order]))

    def reshape(self, shape):
        return self._map(lambda x: x.reshape(*[int(s) for s in shape]))

    def _check_read(self, what: str, access: int = 0):
        if self.pending.any():
            raise GluonHazard(f"{what}: shared memory read while a cp.async into it is in flight (no wait_group)")
        if (self.written & ((self.written_by != access) | (access == 0))).any():
            raise GluonHazard(f"{what}: shared memory read of other threads' writes with no thread_barrier between")

    def _check_write(self, what: str, access: int = 0):
        if self.pending.any():
            raise GluonHazard(f"{what}: shared memory written while a cp.async into it is in flight")
        if (self.read & ((self.read_by != access) | (access == 0))).any():
            raise GluonHazard(f"{what}: shared memory overwritten after other threads read it, no thread_barrier "
                              f"between")
        for w in [w for m in _M.partitions for w in m.wgmmas]:
            for r in w.reads:
                if _overlaps(r, self):
                    raise GluonHazard(f"{what}: shared memory overwritten while an asynchronous wgmma reads it")

    def load(self, layout=None):
        acc = self.access(layout)
        self._check_read("smem.load", acc)
        self.read_by.copy_(torch.where(self.read & (self.read_by != acc), 0, acc))
        self.read.fill_(True)
        return _tagged(self.data.clone(), layout)

    def store(self, value):
        acc = self.access(_lay(value))
        self._check_write("smem.store", acc)
        value = _plain(value)
        if value.dtype != self.data.dtype:
            raise GluonHazard(f"smem.store of {value.dtype} into {self.data.dtype} shared memory")
        if list(value.shape) != self.shape:
            raise GluonHazard(f"smem.store of shape {list(value.shape)} into {self.shape}")
        self.data.copy_(value)
        self.written.fill_(True)
        self.written_by.fill_(acc)
        self.unfenced.fill_(True)


def _overlaps(a: Smem, b: Smem) -> bool:
    """Whether two views share an element (same allocation and overlapping addresses)."""
    if a.data.untyped_storage().data_ptr() != b.data.untyped_storage().data_ptr():
        return False
    probe = torch.zeros(a.data.untyped_storage().nbytes() // a.data.element_size(), dtype=torch.int8)
    pa = torch.as_strided(probe, a.data.shape, a.data.stride(), a.data.storage_offset())
    pa.fill_(1)
    pb = torch.as_strided(probe, b.data.shape, b.data.stride(), b.data.storage_offset())
    return bool((pb == 1).any())


def allocate_shared_memory(element_ty, shape, layout=None, value=None):
    shape = [int(s) for s in shape]
    data = torch.full(shape, float("nan"), dtype=element_ty) if element_ty.is_floating_point else \
        torch.full(shape, -12345, dtype=element_ty)
    s = Smem(data, *(torch.zeros(shape, dtype=torch.bool) for _ in range(4)),
             *(torch.zeros(shape, dtype=torch.int32) for _ in range(2)))
    if value is not None:
        s.store(value)
    _M.allocs.append(s)
    return s


def thread_barrier():
    for s in _M.allocs:
        s.written.fill_(False)
        s.read.fill_(False)


def fence_async_shared(cluster=False):
    for s in _M.allocs:
        s.unfenced.fill_(False)


def async_copy_global_to_shared(smem: Smem, pointer: Ptr, mask=None, **_):
    acc = smem.access(_lay(pointer.off))
    smem._check_write("cp.async", acc)
    if list(pointer.offsets().shape) != smem.shape and mask is None:
        raise GluonHazard(f"cp.async of {list(pointer.offsets().shape)} pointers into {smem.shape}")
    val = load(pointer, mask=mask, other=0)
    val = torch.broadcast_to(_plain(val), smem.shape)
    smem.pending.fill_(True)
    _M.open_group.append((smem, val.to(smem.dtype).clone(), acc))


def commit_group():
    _M.groups.append(_M.open_group)
    _M.open_group = []


def wait_group(num_outstanding=0):
    n = int(num_outstanding)
    while len(_M.groups) > n:
        for smem, val, acc in _M.groups.pop(0):
            smem.data.copy_(val)
            smem.pending.fill_(False)
            smem.written.fill_(True)       # other threads' copies: a barrier before another layout reads them
            smem.written_by.fill_(acc)
            smem.unfenced.fill_(True)


# ---------------------------------------------------------------------------------------------------------------
# tensor-core products


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 truncated to tf32 (the 13 low mantissa bits dropped), as the tensor cores read fp32 operands."""
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def _operand(x, what: str) -> torch.Tensor:
    if isinstance(x, Smem):
        x._check_read(what)
        if x.unfenced.any():
            raise GluonHazard(f"{what}: shared operand written by the generic proxy with no fence_async_shared")
        x = x.data
    if isinstance(x, AsyncAcc):
        raise GluonHazard(f"{what}: an asynchronous wgmma result used as an operand before warpgroup_mma_wait")
    x = _plain(x)
    return _tf32(x).double() if x.dtype == torch.float32 else x.double()


def _product(a, b, acc, use_acc, what):
    A, B = _operand(a, what), _operand(b, what)
    if isinstance(acc, AsyncAcc):
        acc = acc.value
    acc = _plain(acc)
    if A.shape[-1] != B.shape[0] or (A.shape[0], B.shape[1]) != tuple(acc.shape):
        raise GluonHazard(f"{what}: shapes {list(A.shape)} x {list(B.shape)} -> {list(acc.shape)}")
    out = A @ B
    if bool(use_acc):
        out = out + acc.double()
    return out.to(acc.dtype)


class AsyncAcc:
    """An asynchronous wgmma's result: readable only through :func:`warpgroup_mma_wait`."""

    def __init__(self, value, reads):
        self.value, self.reads, self.retired = value, reads, False


def warpgroup_mma(a, b, acc, *, use_acc=True, precision=None, max_num_imprecise_acc=None, is_async=False):
    if isinstance(acc, AsyncAcc) and not acc.retired and acc not in _M.wgmmas:
        raise GluonHazard("warpgroup_mma: accumulator token of an unknown wgmma")
    value = _tagged(_product(a, b, acc, use_acc, "warpgroup_mma"),
                    _lay(acc.value if isinstance(acc, AsyncAcc) else acc))
    if not is_async:
        return value
    reads = [x for x in (a, b) if isinstance(x, Smem)]
    token = AsyncAcc(value, reads)
    _M.wgmmas.append(token)
    return token


def warpgroup_mma_wait(num_outstanding=0, deps=None):
    if deps is None:
        raise ValueError("warpgroup_mma_wait deps must be given")
    n = int(num_outstanding)
    while len(_M.wgmmas) > n:
        _M.wgmmas.pop(0).retired = True
    out = []
    for d in deps:
        if isinstance(d, AsyncAcc):
            if not d.retired:
                raise GluonHazard("warpgroup_mma_wait: a dependency's wgmma is still outstanding after the wait")
            out.append(d.value)
        else:
            out.append(d)
    return out[0] if len(out) == 1 else tuple(out)


def mma_v2(a, b, acc, input_precision=None):
    return _tagged(_product(a, b, acc, True, "mma_v2"), _lay(acc))


# ---------------------------------------------------------------------------------------------------------------
# the gl namespace


def _freeze(x):
    if isinstance(x, _Layout):
        return x.key()
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(y) for y in x)
    return x


class _Layout:
    """A layout: compared by kind and arguments (two layouts built alike are the same threads' mapping)."""
    kind = "layout"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def key(self):
        return (self.kind, _freeze(self.args), _freeze(sorted(self.kwargs.items())))

    def __eq__(self, other):
        return isinstance(other, _Layout) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())

    def slice_args(self):
        dim = self.kwargs.get("dim", self.args[0] if self.args else None)
        parent = self.kwargs.get("parent", self.args[1] if len(self.args) > 1 else None)
        return int(dim), parent

    @classmethod
    def get_default_for(cls, *args, **kwargs):
        return cls(*args, **kwargs)


def _layout_kind(name):
    return type(name, (_Layout,), {"kind": name})


def _constexpr(x=None):
    return x


def _ex2_ftz(x):
    r = torch.exp2(_plain(x).float())
    return _wrap(torch.where(r.abs() < 2.0 ** -126, torch.zeros_like(r), r))


def _lg2_ftz(x):
    x = _plain(x).float()
    return _wrap(torch.log2(torch.where(x.abs() < 2.0 ** -126, torch.zeros_like(x), x)))


_ASM = {
    "ex2.approx.ftz.f32 $0, $1;": lambda args: _ex2_ftz(args[0]),
    "lg2.approx.ftz.f32 $0, $1;": lambda args: _lg2_ftz(args[0]),
    "mov.b64 $0, $1;": lambda args: _t(args[0]),
    "mov.b32 $0, $1;": lambda args: _t(args[0]),
}


def inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack):
    if asm not in _ASM:
        raise NotImplementedError(f"emulator: inline asm {asm!r}")
    return _tagged(_t(_ASM[asm](args), dtype), _lay(args[0]))


def _range(*args):
    """A run-time loop: its variable is an integer tensor of the bounds' type (Triton's scf.for)."""
    dt = torch.int32
    for a in args:
        if isinstance(a, torch.Tensor):
            dt = torch.promote_types(dt, a.dtype)
    for i in range(*[int(a) for a in args]):
        yield _t(i, dt)


def _static_range(*args):
    return range(*[int(a) for a in args])


def _static_assert(cond, msg=""):
    assert cond, msg


def arange(start, end, layout=None):
    return _tagged(torch.arange(int(start), int(end), dtype=torch.int32), layout)


def full(shape, value, dtype, layout=None):
    return _tagged(torch.full([int(s) for s in shape], _plain(value) if not isinstance(value, torch.Tensor) else
                              float(value), dtype=dtype), layout)


def _expand_dims(x, axis):
    lay = _lay(x)
    y = _wrap(_plain(x).unsqueeze(int(axis)))
    if lay is not None and lay.kind == "SliceLayout" and lay.slice_args()[0] == int(axis):
        y._lay = lay.slice_args()[1]
    return y


def zeros(shape, dtype, layout=None):
    return full(shape, 0, dtype)


def zeros_like(x, **_):
    return _tagged(torch.zeros_like(_plain(x)), _lay(x))


def where(cond, a, b):
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        a = _t(a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype != b.dtype:
        dt = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(dt), b.to(dt)
    cond = _t(cond)
    r = _wrap(torch.where(_plain(cond).to(torch.bool), _plain(a), _plain(b)))
    r._lay = _result_layout(None, (cond, a, b), r)
    return r


def _nan_ignoring(x, axis, fn, fill):
    x = _plain(x)
    if x.dtype.is_floating_point:
        nan = torch.isnan(x)
        all_nan = nan.all(dim=axis) if axis is not None else nan.all()
        r = fn(torch.where(nan, fill, x), axis)
        return _wrap(torch.where(all_nan, float("nan"), r))
    return _wrap(fn(x, axis))


def _reduce_dtype(x, floor_fp32=True):
    x = _plain(_t(x))
    if x.dtype == torch.bool or (not x.dtype.is_floating_point and x.element_size() < 4):
        return x.to(torch.int32)
    if floor_fp32 and x.dtype in (torch.bfloat16, torch.float16):
        return x.float()
    return x


def _reduced(fn):
    def reduce(x, axis=None, *args, **kwargs):
        r = fn(x, axis, *args, **kwargs)
        lay = _lay(x)
        if lay is not None and axis is not None and not kwargs.get("keep_dims"):
            r = _tagged(r, _SliceLayout(int(axis), lay))
        return r
    return reduce


def gmax(x, axis=None, keep_dims=False):
    x = _reduce_dtype(x)
    f = (lambda t, a: t.amax() if a is None else t.amax(dim=a, keepdim=keep_dims))
    return _nan_ignoring(x, axis, f, float("-inf"))


def gmin(x, axis=None, keep_dims=False):
    x = _reduce_dtype(x)
    f = (lambda t, a: t.amin() if a is None else t.amin(dim=a, keepdim=keep_dims))
    return _nan_ignoring(x, axis, f, float("inf"))


def gsum(x, axis=None, keep_dims=False, dtype=None):
    x = _reduce_dtype(x, floor_fp32=False)
    r = x.sum() if axis is None else x.sum(dim=int(axis), keepdim=keep_dims)
    return _t(r, dtype)


def greduce(x, axis, combine_fn, keep_dims=False):
    """``gl.reduce``: the combine folded along ``axis`` in index order (the compiled tree's order differs; the kernels
    reduce with exact combines: bitwise and / or, max)."""
    x = _t(x)
    acc = None
    for i in range(x.shape[int(axis)]):
        cur = x.select(int(axis), i)
        acc = cur if acc is None else _plain(combine_fn(acc, cur))
    return _wrap(acc.unsqueeze(int(axis)) if keep_dims else acc)


def associative_scan(x, axis, combine_fn, reverse=False):
    return _tagged(_associative_scan(x, axis, combine_fn, reverse), _lay(x))


def _associative_scan(x, axis, combine_fn, reverse=False):
    x = _t(x)
    axis = int(axis)
    n = x.shape[axis]
    idx = list(range(n))[::-1] if reverse else list(range(n))
    outs = [None] * n
    acc = None
    for i in idx:
        cur = x.select(axis, i)
        acc = cur if acc is None else combine_fn(acc, cur)
        outs[i] = _plain(acc)
    return _wrap(torch.stack(outs, dim=axis))


def _keeps_layout(fn):
    def op(a, b, **kw):
        r = fn(a, b, **kw)
        r._lay = _result_layout(None, (a, b), r)
        return r
    return op


@_keeps_layout
def _maximum(a, b, **_):
    a, b = _t(a) if not isinstance(a, torch.Tensor) else a, _t(b) if not isinstance(b, torch.Tensor) else b
    return _wrap(torch.fmax(a, b) if a.dtype.is_floating_point or b.dtype.is_floating_point else
                 torch.maximum(*[x.to(torch.promote_types(a.dtype, b.dtype)) for x in (_plain(a), _plain(b))]))


@_keeps_layout
def _minimum(a, b, **_):
    a, b = _t(a) if not isinstance(a, torch.Tensor) else a, _t(b) if not isinstance(b, torch.Tensor) else b
    return _wrap(torch.fmin(a, b) if a.dtype.is_floating_point or b.dtype.is_floating_point else
                 torch.minimum(*[x.to(torch.promote_types(a.dtype, b.dtype)) for x in (_plain(a), _plain(b))]))


def _unary(fn):
    return lambda x: _tagged(fn(_plain(_t(x))), _lay(x))


def _program_id(axis):
    return _t(_PROGRAM[int(axis)])


_SliceLayout = _layout_kind("SliceLayout")
_PROGRAM = [0, 0, 0]
_GRID = [1, 1, 1]
_WARPS = [4]

gl_emu = types.SimpleNamespace(
    constexpr=_constexpr, constexpr_function=lambda f: f,
    int1=torch.bool, int8=torch.int8, int16=torch.int16, int32=torch.int32, int64=torch.int64,
    uint8=torch.uint8, float16=torch.float16, bfloat16=torch.bfloat16, float32=torch.float32,
    float64=torch.float64,
    **{n: _layout_kind(n) for n in ("BlockedLayout", "SliceLayout", "NVMMADistributedLayout", "NVMMASharedLayout",
                                    "DotOperandLayout", "SwizzledSharedLayout", "DistributedLinearLayout",
                                    "PaddedSharedLayout", "AutoLayout")},
    program_id=_program_id, num_programs=lambda axis: _t(_GRID[int(axis)]), num_warps=lambda: _WARPS[0],
    arange=arange, full=full, zeros=zeros, zeros_like=zeros_like, where=where,
    load=load, store=store, allocate_shared_memory=allocate_shared_memory, thread_barrier=thread_barrier,
    convert_layout=lambda x, layout=None, assert_trivial=False: _tagged(x, layout),
    sum=_reduced(gsum), max=_reduced(gmax), min=_reduced(gmin), reduce=_reduced(greduce),
    associative_scan=associative_scan,
    maximum=_maximum, minimum=_minimum,
    exp=_unary(torch.exp), exp2=_unary(torch.exp2), log=_unary(torch.log), log2=_unary(torch.log2),
    sqrt=_unary(torch.sqrt), rsqrt=_unary(torch.rsqrt), abs=_unary(torch.abs),
    sigmoid=_unary(torch.sigmoid),
    expand_dims=_expand_dims,
    reshape=lambda x, shape, **_: _wrap(_plain(x).reshape([int(s) for s in shape])),
    permute=lambda x, dims: _wrap(_plain(x).permute(*[int(d) for d in dims])),
    cdiv=lambda a, b: (a + b - 1) // b,
    to_tensor=_t, static_range=_static_range, static_assert=_static_assert,
    inline_asm_elementwise=inline_asm_elementwise, warp_specialize=lambda *a, **k: warp_specialize(*a, **k),
)

async_copy_emu = types.SimpleNamespace(async_copy_global_to_shared=async_copy_global_to_shared,
                                       commit_group=commit_group, wait_group=wait_group)

_HOPPER = {"warpgroup_mma": warpgroup_mma, "warpgroup_mma_wait": warpgroup_mma_wait,
           "fence_async_shared": fence_async_shared, "mma_v2": mma_v2}


# ---------------------------------------------------------------------------------------------------------------
# mbarriers and warp specialisation


class _MBarrier:
    def __init__(self, count: int):
        self.count, self.pending, self.completed = count, count, 0


_MBARRIERS: dict = {}


def _mbar(bar: Smem) -> _MBarrier:
    key = (bar.data.untyped_storage().data_ptr(), bar.data.storage_offset())
    if key not in _MBARRIERS:
        raise GluonHazard("mbarrier used before mbarrier.init")
    return _MBARRIERS[key]


def mbarrier_init(bar: Smem, count):
    _MBARRIERS[(bar.data.untyped_storage().data_ptr(), bar.data.storage_offset())] = _MBarrier(int(count))


def mbarrier_arrive(bar: Smem, *, count=1, pred=True):
    if not bool(pred):
        return
    b = _mbar(bar)
    b.pending -= int(count)
    if b.pending < 0:
        raise GluonHazard("mbarrier: more arrivals than its count")
    if b.pending == 0:
        b.completed += 1
        b.pending = b.count


def mbarrier_wait(bar: Smem, phase, pred=True, deps=()):
    """Returns once the phase of parity ``phase`` has completed (the current phase's parity differs from it)."""
    b = _mbar(bar)
    parity = int(phase) & 1
    if _SCHED is None:
        if b.completed % 2 == parity:
            raise GluonHazard("mbarrier.wait on a phase that never completes (no other partition)")
        return
    _SCHED.block_until(lambda: b.completed % 2 != parity)


class _Scheduler:
    """Runs a program's partitions one at a time in threads; a partition gives way only while it waits on an
    mbarrier (then the next runnable partition in order runs)."""

    def __init__(self, n: int):
        import threading
        self.cv = threading.Condition()
        self.turn = 0
        self.done = [False] * n
        self.waiting = [None] * n     # the predicate a blocked partition waits for
        self.machines: List[_Machine] = []
        self.error = None

    def _next(self, me: int):
        n = len(self.done)
        for step in range(1, n + 1):
            j = (me + step) % n
            if not self.done[j] and (self.waiting[j] is None or self.waiting[j]()):
                return j
        return None

    def block_until(self, ready):
        global _M
        me = self.turn
        with self.cv:
            while not ready():
                self.waiting[me] = ready
                nxt = self._next(me)           # never ``me``: its own wait is not ready
                if nxt is None:
                    raise self._fail(GluonHazard("mbarrier deadlock: every partition waits"))
                self.turn = nxt
                self.cv.notify_all()
                while self.turn != me:
                    if self.error is not None:
                        raise self.error
                    self.cv.wait()
                _M = self.machines[me]
            self.waiting[me] = None

    def run(self, me: int, fn, args):
        global _M
        with self.cv:
            while self.turn != me:
                if self.error is not None:
                    return
                self.cv.wait()
            _M = self.machines[me]
        try:
            fn(*args)
            _M.check_end(f"partition {me}")
        except BaseException as e:  # noqa: BLE001 - the first error of any partition is the program's
            with self.cv:
                self._fail(e)
            return
        with self.cv:
            self.done[me] = True
            self.waiting[me] = None
            nxt = self._next(me)
            if nxt is not None:
                self.turn = nxt
                self.cv.notify_all()
            elif not all(self.done):
                self._fail(GluonHazard("mbarrier deadlock: every partition left waits"))

    def _fail(self, error):
        """Records the program's first error and wakes every partition to end (called holding the lock)."""
        if self.error is None:
            self.error = error
        self.turn = -1
        self.cv.notify_all()
        return self.error


_SCHED: Optional[_Scheduler] = None


def warp_specialize(functions_and_args, worker_num_warps, worker_num_regs):
    """The default partition and the workers, interleaved at their mbarrier waits (see the module's docstring)."""
    global _M, _SCHED
    import threading
    if _SCHED is not None:
        raise GluonHazard("warp_specialize inside a partition")
    if len(worker_num_warps) != len(functions_and_args) - 1 or len(worker_num_regs) != len(worker_num_warps):
        raise GluonHazard("warp_specialize: one warp count and one register count per worker partition")
    parent = _M
    if parent.groups or parent.open_group or parent.wgmmas:
        raise GluonHazard("warp_specialize with cp.async groups or wgmmas of the parent outstanding")
    sched = _Scheduler(len(functions_and_args))
    partitions: List[_Machine] = []
    sched.machines = [_Machine(parent.allocs, partitions) for _ in functions_and_args]
    partitions.extend(sched.machines)
    _SCHED = sched
    threads = [threading.Thread(target=sched.run, args=(i, fn, tuple(args)))
               for i, (fn, args) in enumerate(functions_and_args)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        _SCHED = None
        _M = parent
    if sched.error is not None:
        raise sched.error


mbarrier_emu = types.SimpleNamespace(init=mbarrier_init, arrive=mbarrier_arrive, wait=mbarrier_wait,
                                     expect=lambda *a, **k: None, invalidate=lambda bar: None,
                                     MBarrierLayout=lambda *a, **k: _Layout("MBarrierLayout"))


# ---------------------------------------------------------------------------------------------------------------
# kernels: their Python bodies rebound to the emulated namespace


_EMULATED = {}


def _emulated(fn_obj):
    """The Python function of a Gluon JIT function (or a plain helper), its globals rebound to the emulator."""
    key = id(fn_obj)
    if key in _EMULATED:
        return _EMULATED[key]
    fn = getattr(fn_obj, "fn", fn_obj)
    g = dict(fn.__globals__)
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    _EMULATED[key] = new
    for name, val in list(g.items()):
        g[name] = _translate(name, val)
    g["range"] = _range
    return new


def _translate(name, val):
    mod = getattr(val, "__name__", "") if isinstance(val, types.ModuleType) else ""
    if mod.startswith("triton.experimental.gluon.language"):
        if mod.endswith("async_copy"):
            return async_copy_emu
        if mod.endswith("mbarrier"):
            return mbarrier_emu
        if mod == "triton.experimental.gluon.language":
            return gl_emu
        return val
    cls = type(val).__name__
    if cls in ("GluonJITFunction", "JITFunction", "InterpretedFunction"):
        return _emulated(val)
    if cls == "ConstexprFunction":
        return val.fn
    if cls == "constexpr":
        return val.value
    vmod = getattr(val, "__module__", "") or ""
    if callable(val) and vmod.startswith("triton.experimental.gluon") and name in _HOPPER:
        return _HOPPER[name]
    return val


def run_kernel(kernel, grid, *args, **kwargs):
    """Run a Gluon kernel's every program on the emulator (launch options dropped)."""
    global _M
    import inspect
    fn = kernel.fn
    sig = inspect.signature(fn)
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k not in sig.parameters}
    _WARPS[0] = int(opts.get("num_warps", 4))
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    call = {}
    for name, val in bound.arguments.items():
        ann = fn.__annotations__.get(name)
        constexpr = ann is not None and "constexpr" in str(ann)
        if isinstance(val, torch.Tensor):
            call[name] = _ptr_of(val, name)
        elif constexpr or val is None:
            call[name] = val
        elif isinstance(val, bool):
            call[name] = _t(val)
        elif isinstance(val, int):
            call[name] = _t(val, torch.int32 if -2 ** 31 <= val < 2 ** 31 else torch.int64)
        elif isinstance(val, float):
            call[name] = _t(val, torch.float32)
        else:
            call[name] = val
    body = _emulated(kernel)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    _GRID[:] = [int(x) for x in grid]
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                _PROGRAM[:] = [x, y, z]
                _M = _Machine()
                body(**call)
                _M.check_end("program")
    _M = None


@contextlib.contextmanager
def emulated_gluon():
    """Every Gluon kernel launched inside runs on the emulator."""
    from triton.experimental.gluon._runtime import GluonJITFunction

    orig = GluonJITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            raise RuntimeError("emulated Gluon kernels are not compiled")
        return run_kernel(self, grid, *args, **kwargs)

    GluonJITFunction.run = run
    try:
        yield
    finally:
        GluonJITFunction.run = orig


@contextlib.contextmanager
def interpreter_bf16():
    """Inside: Triton's CPU interpreter computes bfloat16 as the GPU does (its ``tl.dot`` multiplies bf16 operands
    as their uint16 storage, and its float32 -> bfloat16 casts truncate): bf16 operands are widened exactly before
    the product, and the casts round to nearest even. For the Triton kernels that run next to emulated Gluon ones."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    B = interp.InterpreterBuilder
    cast_impl, create_dot = B.cast_impl, B.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return (h.data.astype(np.uint32) << 16).view(np.float32)
        return h.data

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.matmul(widen(a), widen(b), dtype=np.float32) + d.data
        return interp.TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            out[np.isnan(src.data)] = 0x7FC0
            return interp.TensorHandle(out, dst_type.scalar)
        return cast_impl(self, src, dst_type)

    B.cast_impl, B.create_dot = cast, dot
    try:
        yield
    finally:
        B.cast_impl, B.create_dot = cast_impl, create_dot


GPU_SMS = 132       # an H100 / H200: the launch decisions that count SMs (pieces, grids) take the GPU's


@contextlib.contextmanager
def on_cpu(monkeypatch):
    """delta-attn's Gluon kernels on CPU tensors: the dispatch opened to the CPU (Gluon available, the Triton release
    and the sm_90 GPU the kernels are written for, with its SM count; bfloat16 allowed for the Triton backend), every
    Gluon launch on the emulator and the Triton kernels beside them on the interpreter with the GPU's bfloat16
    arithmetic."""
    from delta_attn.ops.kda import launch
    monkeypatch.setattr(launch, "gluon_available", lambda device: True)
    monkeypatch.setattr(launch, "gluon_version", lambda: launch.KERNELS_TRITON)
    monkeypatch.setattr(launch, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(launch, "sm_count", lambda device: GPU_SMS)
    with emulated_gluon(), triton_bf16_on_cpu(monkeypatch):
        yield


@contextlib.contextmanager
def triton_bf16_on_cpu(monkeypatch):
    """The Triton backend on CPU tensors in bfloat16: the registry's refusal lifted and the interpreter computing
    bfloat16 as the GPU does (:func:`interpreter_bf16`)."""
    from delta_attn import backends
    triton_backend = backends.BACKENDS["triton"]
    rule = triton_backend._device_rule
    monkeypatch.setattr(triton_backend, "_device_rule", lambda call: [] if call.device.type == "cpu" else rule(call))
    with interpreter_bf16():
        yield


def gpu_module_on_cpu(name: str):
    """tests/gpu/<name>.py loaded again as its own module with its device (``DEV``) the CPU: its check functions
    then run on the emulator inside :func:`on_cpu`."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parent / "gpu" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"emulated_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.DEV = "cpu"
    return mod
