"""cuDNN and PyTorch-SDPA backends for attention, and the measured ``auto`` policy.

``backend="cudnn"``
  * dense calls that PyTorch's SDPA cuDNN backend can run as they are (no window, no GQA,
    causal only with Sq == Sk because SDPA aligns causal masks top-left, equal head dims): through
    ``aten::_scaled_dot_product_cudnn_attention`` (forward, LSE, backward via autograd);
  * every other supported call, and every varlen call (``"thd"`` and ``"htd"``): cuDNN fused
    attention graphs built with the cudnn-frontend Python API: ragged offsets for the packed
    tensors, a padding mask with per-sequence ``seq_len_q`` / ``seq_len_kv``, the diagonal band
    aligned bottom-right (our causal and window semantics, Sq != Sk), GQA, softmax scale, the
    softmax statistics as LSE, and forward + backward under autograd (:class:`CudnnVarlenFunction`).

Graphs are cached per (device, dtype, heads, head dims, layout, mask bounds, scale) and *bucketed*
sizes (sequence count rounded up to a power of two, max lengths to 1/8 octave, the backward's token
totals to a power of two; "htd" graphs need the exact token totals, which are their head strides),
with their plans; the workspace is one growing buffer per device. A training loop whose
``cu_seqlens`` change every step therefore reuses a handful of graphs (:func:`graph_cache_stats`).

``backend="sdpa"`` lives in :mod:`delta_attn.ops.flash.sdpa`, which registers itself; this module registers
``cudnn`` and installs the attention ``auto`` policy. Both are imported by ``ops/flash/api.py``.

Nothing here imports ``cudnn`` (the frontend) at ``import delta_attn`` time.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import torch

from ... import _install, _outputs
from ... import backends as B
from ...backends import Call, Capability, register, set_auto_policy

CUDNN_FRONTEND_HINT = _install.CUDNN

# cuDNN's diagonal band: key j is visible from query i when
#   i + Sk - Sq - left_bound < j <= i + Sk - Sq + right_bound   (BOTTOM_RIGHT alignment)
# so our window_size[0] = wl maps to left_bound = wl + 1 and window_size[1] = wr to right_bound = wr.
LEFT_BOUND_OFFSET = 1
# When every sequence has Sq == Sk (one cu_seqlens tensor for both, or a dense call with Sq == Sk),
# top-left and bottom-right alignment are the same mask; the graph is then built TOP_LEFT.
TOP_LEFT_WHEN_EQUAL = True
# cuDNN heuristics modes used to rank the engines of a graph (first that builds wins)
HEUR_MODES = ("A", "FALLBACK")
# "htd" graphs are keyed on the exact token totals (their head strides); after this many distinct
# totals for one signature without a cached graph, the call is transposed to "thd" instead (two
# copies per tensor, ~1-2% of the attention time) so that changing totals stop rebuilding graphs.
HTD_MAX_TOTALS = 4

# ---------------------------------------------------------------------------------------------
# capability declarations
# ---------------------------------------------------------------------------------------------

_MAX_HEAD_DIM = 128     # declared (and tested) for cuDNN 9.x on sm90; larger dims are not claimed


def _cudnn_head_dims(dims: Tuple[int, ...]) -> Optional[str]:
    bad = [d for d in dims if d % 8 != 0 or d > _MAX_HEAD_DIM]
    if bad:
        return f"head dims must be multiples of 8 and at most {_MAX_HEAD_DIM} for cuDNN fused attention, got {'x'.join(map(str, dims))}"
    return None


@lru_cache(maxsize=None)
def _torch_cudnn_version() -> Optional[int]:
    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:   # noqa: BLE001 — a broken cuDNN install is just "not available"
        return None


# features of a dense call that the SDPA cuDNN path cannot take and that need cudnn-frontend graphs
# (single_token: PyTorch's cuDNN SDPA raises "s_q = s_kv = 1 is not supported"; the graphs bucket lengths to 64)
_NEEDS_GRAPH = frozenset({"window", "gqa", "deterministic", "head_dim_v", "single_token"})


def dense_needs_graph(features) -> bool:
    return bool(features & _NEEDS_GRAPH) or ("causal" in features and "sq_ne_sk" in features)


def _cudnn_library_reasons(min_version: int) -> List[str]:
    ver = _torch_cudnn_version()
    if ver is None:
        return ["PyTorch has no cuDNN library here"]
    if ver < min_version:
        return [f"needs cuDNN >= {min_version // 10000}.{min_version // 100 % 100}, PyTorch loads {ver}"]
    return []


_frontend_error: List[Optional[str]] = []


def frontend_error() -> Optional[str]:
    """Why the installed cudnn-frontend cannot be imported (None when it can). Imported once, lazily."""
    if not _frontend_error:
        try:
            import cudnn  # noqa: F401
            _frontend_error.append(None)
        except Exception as e:   # noqa: BLE001 — e.g. a missing library or dependency
            _frontend_error.append(f"cudnn-frontend is installed but does not import ({type(e).__name__}: {e})")
    return _frontend_error[0]


def _check_cudnn_dense(call: Call) -> List[str]:
    if call.device.type != "cuda":
        return []
    reasons = _cudnn_library_reasons(90000)
    if dense_needs_graph(call.features):
        what = sorted(call.features & _NEEDS_GRAPH) or ["causal with Sq != Sk"]
        if call.compiling:
            reasons.append(f"{', '.join(what)} on dense calls run cudnn-frontend graphs from Python, which "
                           f"torch.compile cannot trace")
        if not B.package_available("cudnn"):
            reasons.append(f"{', '.join(what)} on dense calls need cudnn-frontend graphs: nvidia-cudnn-frontend not "
                           f"installed — {CUDNN_FRONTEND_HINT}")
        elif frontend_error():
            reasons.append(frontend_error())
        cc = B.device_capability(call.device)
        if cc is not None and cc < (9, 0):
            reasons.append(f"{', '.join(what)} on dense calls use ragged cuDNN graphs, which need compute "
                           f"capability >= 9.0, device has {cc[0]}.{cc[1]}")
    return reasons


def _check_cudnn_varlen(call: Call) -> List[str]:
    if call.device.type != "cuda":
        return []
    reasons = _cudnn_library_reasons(90600)
    if B.package_available("cudnn") and frontend_error():
        reasons.append(frontend_error())
    return reasons


_FP = (torch.float16, torch.bfloat16)
register("cudnn", "flash", Capability(
    impl="delta_attn.ops.flash.cudnn:attention", dtypes=_FP, min_compute_capability=(8, 0),
    features=frozenset({"causal", "sq_ne_sk"}) | _NEEDS_GRAPH, head_dims=_cudnn_head_dims,
    check=_check_cudnn_dense, install_hint=CUDNN_FRONTEND_HINT))
register("cudnn", "flash_varlen", Capability(
    impl="delta_attn.ops.flash.cudnn:attention", dtypes=_FP, min_compute_capability=(9, 0),
    features=frozenset({"causal", "window", "gqa", "deterministic", "head_dim_v", "varlen", "layout_htd"}),
    requires=("cudnn",), install_hint=CUDNN_FRONTEND_HINT, head_dims=_cudnn_head_dims, check=_check_cudnn_varlen,
    traceable=False))    # cudnn-frontend graphs are executed from Python

# ---------------------------------------------------------------------------------------------
# auto policy (measurements: docs/DISPATCH.md)
# ---------------------------------------------------------------------------------------------


# The order on sm90+ per (operator, training): training = some input requires grad, so the backward
# follows and forward+backward time decides; otherwise the forward time decides.
SM90_ORDER = {
    ("flash", False): ("cudnn", "triton", "sdpa", "torch"),
    ("flash", True): ("cudnn", "triton", "sdpa", "torch"),
    ("flash_varlen", False): ("cudnn", "triton", "sdpa", "torch"),
    ("flash_varlen", True): ("cudnn", "triton", "sdpa", "torch"),
}
SM90_WHY = {
    ("flash", False): "dense forward: cuDNN fastest on every H200 benchmark shape",
    ("flash", True): "dense forward+backward: cuDNN fastest on every H200 benchmark shape",
    ("flash_varlen", False): "varlen forward: the cuDNN ragged graph is fastest on the H200 mixed batch",
    ("flash_varlen", True): "varlen forward+backward: the cuDNN ragged graphs are fastest on the H200 mixed batch",
}


def _flash_policy(call: Call) -> Tuple[str, ...]:
    cc = B.device_capability(call.device) if call.device.type == "cuda" else None
    if cc is None:
        return B._DEFAULT_ORDER[call.op]
    if cc >= (9, 0):
        return SM90_ORDER[(call.op, call.needs_grad)]
    # Ampere / Ada: not measured by us; cuDNN and FA2 are close there, ours last among fused paths
    return ("cudnn", "sdpa", "triton", "torch")


def _policy_note(call: Call) -> str:
    cc = B.device_capability(call.device) if call.device.type == "cuda" else None
    if cc is None:
        return "not a CUDA call: default order"
    if cc >= (9, 0):
        return f"sm90+, {SM90_WHY[(call.op, call.needs_grad)]} (docs/DISPATCH.md)"
    return f"sm{cc[0]}{cc[1]}: cudnn > sdpa > triton (not measured on this architecture)"


_flash_policy.describe = _policy_note
set_auto_policy("flash", _flash_policy)
set_auto_policy("flash_varlen", _flash_policy)

# ---------------------------------------------------------------------------------------------
# dense path through PyTorch SDPA's cuDNN backend
# ---------------------------------------------------------------------------------------------


def _dense_sdpa_cudnn(a: AttnArgs):
    b, sq, hq, _ = a.q.shape
    q, k, v = (t.transpose(1, 2) for t in (a.q, a.k, a.v))      # (B, H, S, D) views of BSHD memory
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, a.causal, False,
                                                             scale=a.softmax_scale)
    out, lse = res[0], res[1]
    return out.transpose(1, 2), lse.reshape(b, hq, sq)


# ---------------------------------------------------------------------------------------------
# cudnn-frontend graphs: ragged (varlen) attention
# ---------------------------------------------------------------------------------------------

_lock = threading.Lock()
_graphs: Dict[tuple, "_Graph"] = {}
_stats = {"builds": 0, "hits": 0, "build_seconds": 0.0}
_handles: Dict[int, object] = {}
_workspaces: Dict[int, torch.Tensor] = {}
MAX_CACHED_GRAPHS = 256


def graph_cache_stats(reset: bool = False) -> Dict[str, float]:
    """Builds, hits, hit rate and total build seconds of the cudnn-frontend graph cache."""
    with _lock:
        s = dict(_stats, cached=len(_graphs))
        total = s["builds"] + s["hits"]
        s["hit_rate"] = s["hits"] / total if total else float("nan")
        if reset:
            _stats.update(builds=0, hits=0, build_seconds=0.0)
        return s


def clear_graph_cache() -> None:
    with _lock:
        _graphs.clear()


def bucket_len(n: int, floor: int = 64) -> int:
    """Round up to 1/8 octave (multiples of max(floor, 2**(floor(log2 n) - 3))): < 12.5% padding."""
    if n <= floor:
        return floor
    step = max(floor, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


def bucket_batch(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass
class _Graph:
    graph: object
    uids: Tuple[int, ...]
    workspace: int


def _cudnn():
    import cudnn   # noqa: F401 — the optional dependency, imported on first use
    return cudnn


def _handle(device: torch.device):
    cudnn = _cudnn()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    h = _handles.get(idx)
    if h is None:
        with torch.cuda.device(idx):
            h = _handles[idx] = cudnn.create_handle()
    cudnn.set_stream(h, torch.cuda.current_stream(idx).cuda_stream)
    return h


def _workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ws = _workspaces.get(idx)
    if ws is None or ws.numel() < nbytes:
        ws = _workspaces[idx] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    return ws


# UIDs of the graph tensors (fixed, so the ordered execute form can be used)
_Q, _K, _V, _O, _STATS, _DO, _DQ, _DK, _DV = 1, 2, 3, 4, 5, 6, 7, 8, 9
_SLQ, _SLK, _RQ, _RK, _RV, _RO, _RS = 20, 21, 22, 23, 24, 25, 26


@dataclass(frozen=True)
class _Spec:
    """Everything a graph depends on (the cache key)."""
    device: int
    dtype: torch.dtype
    hq: int
    hk: int
    d: int
    dv: int
    layout: str              # "thd" / "htd"
    left: Optional[int]      # cuDNN bounds (None = unbounded)
    right: Optional[int]
    scale: float
    b: int                   # bucketed sequence count
    sq: int                  # bucketed max lengths
    sk: int
    tq: int                  # token totals: exact for "htd" (head strides); thd: 0 (fwd) / next power of 2 (bwd)
    tk: int
    backward: bool
    deterministic: bool
    top_left: bool = False
    heur: Tuple[str, ...] = ("A", "FALLBACK")


def _strides(spec: _Spec, heads: int, dim: int, s: int, total: int):
    if spec.layout == "thd":     # (T, H, D): element (b, h, s, d) at off[b] + s*H*D + h*D + d
        return [s * heads * dim, dim, heads * dim, 1]
    return [s * dim, total * dim, dim, 1]   # (H, T, D): off[b] + h*T*D + s*D + d


def _dtype(cudnn, dt: torch.dtype):
    return cudnn.data_type.BFLOAT16 if dt == torch.bfloat16 else cudnn.data_type.HALF


def _build(spec: _Spec) -> _Graph:
    cudnn = _cudnn()
    dev = torch.device("cuda", spec.device)
    io = _dtype(cudnn, spec.dtype)
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=_handle(dev))
    i32, i64, f32 = cudnn.data_type.INT32, cudnn.data_type.INT64, cudnn.data_type.FLOAT
    nb = spec.b

    def meta(name, uid, n, dt):
        return g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt, uid=uid)

    rq, rk, rv, ro, rs = (meta(n, u, nb + 1, i64) for n, u in (("rq", _RQ), ("rk", _RK), ("rv", _RV),
                                                              ("ro", _RO), ("rs", _RS)))
    slq, slk = meta("slq", _SLQ, nb, i32), meta("slk", _SLK, nb, i32)

    def data(name, uid, heads, dim, s, total, ragged):
        t = g.tensor(name=name, dim=[nb, heads, s, dim], stride=_strides(spec, heads, dim, s, total), data_type=io,
                     uid=uid)
        t.set_ragged_offset(ragged)
        return t

    q = data("q", _Q, spec.hq, spec.d, spec.sq, spec.tq, rq)
    k = data("k", _K, spec.hk, spec.d, spec.sk, spec.tk, rk)
    v = data("v", _V, spec.hk, spec.dv, spec.sk, spec.tk, rv)
    mask = dict(attn_scale=spec.scale, use_padding_mask=True, seq_len_q=slq, seq_len_kv=slk,
                diagonal_alignment=(cudnn.diagonal_alignment.TOP_LEFT if spec.top_left
                                    else cudnn.diagonal_alignment.BOTTOM_RIGHT),
                diagonal_band_left_bound=spec.left, diagonal_band_right_bound=spec.right)
    o_dims, o_strides = [nb, spec.hq, spec.sq, spec.dv], _strides(spec, spec.hq, spec.dv, spec.sq, spec.tq)
    st_dims, st_strides = [nb, spec.hq, spec.sq, 1], [spec.sq * spec.hq, 1, spec.hq, 1]   # (Tq, Hq) token-major
    if not spec.backward:
        o, st = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, **mask)
        o.set_output(True).set_dim(o_dims).set_stride(o_strides).set_uid(_O).set_ragged_offset(ro)
        st.set_output(True).set_data_type(f32).set_dim(st_dims).set_stride(st_strides).set_uid(_STATS) \
            .set_ragged_offset(rs)
        uids = (_Q, _K, _V, _O, _STATS, _SLQ, _SLK, _RQ, _RK, _RV, _RO, _RS)
    else:
        o = data("o", _O, spec.hq, spec.dv, spec.sq, spec.tq, ro)
        do = data("do", _DO, spec.hq, spec.dv, spec.sq, spec.tq, ro)
        st = g.tensor(name="stats", dim=st_dims, stride=st_strides, data_type=f32, uid=_STATS)
        st.set_ragged_offset(rs)
        dq, dk, dv = g.sdpa_backward(name="sdpa_bwd", q=q, k=k, v=v, o=o, dO=do, stats=st,
                                     use_deterministic_algorithm=spec.deterministic,
                                     max_total_seq_len_q=spec.tq, max_total_seq_len_kv=spec.tk, **mask)
        dq.set_output(True).set_dim([nb, spec.hq, spec.sq, spec.d]).set_stride(
            _strides(spec, spec.hq, spec.d, spec.sq, spec.tq)).set_uid(_DQ).set_ragged_offset(rq)
        dk.set_output(True).set_dim([nb, spec.hk, spec.sk, spec.d]).set_stride(
            _strides(spec, spec.hk, spec.d, spec.sk, spec.tk)).set_uid(_DK).set_ragged_offset(rk)
        dv.set_output(True).set_dim([nb, spec.hk, spec.sk, spec.dv]).set_stride(
            _strides(spec, spec.hk, spec.dv, spec.sk, spec.tk)).set_uid(_DV).set_ragged_offset(rv)
        uids = (_Q, _K, _V, _O, _DO, _STATS, _DQ, _DK, _DV, _SLQ, _SLK, _RQ, _RK, _RV, _RO, _RS)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in spec.heur])
    g.check_support()
    g.build_plans()
    return _Graph(g, uids, int(g.get_workspace_size()))


def _graph(spec: _Spec) -> _Graph:
    with _lock:
        hit = _graphs.get(spec)
        if hit is not None:
            _stats["hits"] += 1
            return hit
    t0 = time.perf_counter()
    try:
        built = _build(spec)
    except Exception as e:   # noqa: BLE001 — surface cuDNN's refusal as our error type
        raise B.UnsupportedError(f"cuDNN could not build an attention graph for {spec}: {e}") from e
    with _lock:
        _stats["builds"] += 1
        _stats["build_seconds"] += time.perf_counter() - t0
        if len(_graphs) >= MAX_CACHED_GRAPHS:
            _graphs.pop(next(iter(_graphs)))
        _graphs[spec] = built
    return built


# ----- per-call metadata (ragged offsets, lengths, rows with no visible key) -------------------


@dataclass
class _Meta:
    nb: int                      # bucketed sequence count
    slq: torch.Tensor            # (nb,) int32 query rows cuDNN computes per sequence
    slk: torch.Tensor            # (nb,) int32 keys per sequence
    q_start: torch.Tensor        # (nb + 1,) int64 first computed query token per sequence
    k_start: torch.Tensor        # (nb + 1,) int64
    empty_q: Optional[torch.Tensor]   # (Tq,) bool: query rows that see no key (None: there are none)
    dead_k: Optional[torch.Tensor]    # (Tk,) bool: keys of sequences with no computed query row
    cache: Dict[tuple, torch.Tensor]  # offsets scaled per tensor (key: multiplier)

    def offsets(self, which: str, mult: int) -> torch.Tensor:
        key = (which, mult)
        t = self.cache.get(key)
        if t is None:
            t = self.cache[key] = (self.q_start if which == "q" else self.k_start) * mult
        return t


_meta_memo: Dict[int, tuple] = {}


def _prepare(cu_q: torch.Tensor, cu_k: torch.Tensor, tq: int, tk: int, wr: int, nb: int,
             uniform_shift: Optional[int]) -> _Meta:
    """Offsets and lengths for one call, computed on the device (no host synchronisation).

    Rows with no visible key are exactly the first ``empty`` rows of a sequence (``Sk == 0``, or
    ``i < Sq - Sk - wr`` under a right bound): cuDNN is given the rest of the sequence
    (bottom-right alignment is unchanged by dropping rows from the top) and we write zeros and
    lse = +inf there. ``uniform_shift`` is that count when the host knows it (dense calls).
    """
    memo_key = (id(cu_q), id(cu_k), tq, tk, wr, nb, uniform_shift)
    hit = _meta_memo.get(memo_key)
    if hit is not None:
        ref_q, ref_k, vq, vk, meta = hit
        if ref_q() is cu_q and ref_k() is cu_k and vq == cu_q._version and vk == cu_k._version:
            return meta
    n = cu_q.numel() - 1
    lq = (cu_q[1:] - cu_q[:-1]).long()
    lk = (cu_k[1:] - cu_k[:-1]).long()
    empty_q = dead_k = None
    if uniform_shift is not None:
        empty = torch.full_like(lq, uniform_shift) if uniform_shift else None
    elif cu_q is cu_k:
        empty = None     # Sq == Sk in every sequence: every row sees its diagonal key
    else:
        empty = torch.where(lk == 0, lq, (lq - lk - wr).clamp(min=0) if wr >= 0 else torch.zeros_like(lq))
        empty = torch.minimum(empty, lq)
    q0 = cu_q[:-1].long()
    sq_eff = lq if empty is None else lq - empty
    if empty is not None:
        q0 = q0 + empty
        tok = torch.arange(tq, device=cu_q.device)
        seq = torch.searchsorted(cu_q[1:].long(), tok, right=True).clamp(max=max(n - 1, 0))
        empty_q = (tok - cu_q[:-1].long()[seq]) < empty[seq] if n else None
        ktok = torch.arange(tk, device=cu_q.device)
        kseq = torch.searchsorted(cu_k[1:].long(), ktok, right=True).clamp(max=max(n - 1, 0))
        dead_k = (sq_eff == 0)[kseq] if n else None
    pad = nb - n
    dev = cu_q.device
    q_start = torch.cat([q0, torch.full((pad + 1,), tq, dtype=torch.long, device=dev)])
    k_start = torch.cat([cu_k[:-1].long(), torch.full((pad + 1,), tk, dtype=torch.long, device=dev)])
    zeros = torch.zeros(pad, dtype=torch.int32, device=dev)
    slq = torch.cat([sq_eff.int(), zeros])
    slk = torch.cat([lk.int(), zeros])
    meta = _Meta(nb, slq, slk, q_start, k_start, empty_q, dead_k, {})
    if len(_meta_memo) > 16:
        _meta_memo.clear()
    _meta_memo[memo_key] = (weakref.ref(cu_q), weakref.ref(cu_k), cu_q._version, cu_k._version, meta)
    return meta


def _bounds(window: Tuple[int, int], max_len: int) -> Tuple[Optional[int], Optional[int]]:
    """cuDNN's (left, right) diagonal bands. cuDNN takes a left bound only with a right bound, so an open
    right bound becomes ``max_len``: with bottom-right alignment row i sees keys up to i + Sk - Sq + right,
    so "unbounded" needs right >= Sq - 1 as well as >= Sk - 1 (max_sk alone cut every key from the first
    rows once Sq > Sk + 1: window (0, -1), Sq 300, Sk 17 gave NaN lse on the H200)."""
    wl, wr = window
    left = wl + LEFT_BOUND_OFFSET if wl >= 0 else None
    right = wr if wr >= 0 else None
    if left is not None and right is None:
        right = max_len
    return left, right


@dataclass(frozen=True)
class _Call:
    """One ragged call: tensors in "thd" (T, H, D) or "htd" (H, T, D) layout."""
    layout: str
    hq: int
    hk: int
    d: int
    dv: int
    tq: int
    tk: int
    max_sq: int
    max_sk: int
    scale: float
    window: Tuple[int, int]
    deterministic: bool
    equal_lengths: bool = False      # Sq == Sk in every sequence

    def spec(self, dtype, device, nb, backward) -> _Spec:
        left, right = _bounds(self.window, bucket_len(max(self.max_sk, self.max_sq)))
        if self.layout == "htd":         # the token totals are the head strides: exact
            tq, tk = self.tq, self.tk
        elif backward:                   # they only size the backward's workspace: next power of two
            tq, tk = bucket_batch(self.tq), bucket_batch(self.tk)
        else:                            # the thd forward does not depend on them
            tq = tk = 0
        return _Spec(device.index if device.index is not None else torch.cuda.current_device(), dtype,
                     self.hq, self.hk, self.d, self.dv, self.layout, left, right, float(self.scale), nb,
                     bucket_len(self.max_sq), bucket_len(self.max_sk), tq, tk, backward,
                     self.deterministic and backward, TOP_LEFT_WHEN_EQUAL and self.equal_lengths, tuple(HEUR_MODES))


def _token_dim(layout: str) -> int:
    return 0 if layout == "thd" else 1


def _packed(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The packed layout cuDNN is told about: (T, H, D) or (H, T, D) contiguous, 16-byte aligned."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _fix_rows(x: torch.Tensor, mask: Optional[torch.Tensor], layout: str, value: float) -> None:
    if mask is None:
        return
    view = mask[:, None, None] if layout == "thd" else mask[None, :, None]
    x.masked_fill_(view, value)


def _execute(graph: _Graph, buffers: Dict[int, torch.Tensor], device) -> None:
    ws = _workspace(device, graph.workspace)
    graph.graph.execute([buffers[u] for u in graph.uids], ws, handle=_handle(device), tensor_uids=graph.uids)


def _meta_buffers(c: _Call, m: _Meta) -> Dict[int, torch.Tensor]:
    if c.layout == "thd":
        mq, mk, mv, mo = c.hq * c.d, c.hk * c.d, c.hk * c.dv, c.hq * c.dv
    else:
        mq, mk, mv, mo = c.d, c.d, c.dv, c.dv
    return {_SLQ: m.slq, _SLK: m.slk, _RQ: m.offsets("q", mq), _RK: m.offsets("k", mk),
            _RV: m.offsets("k", mv), _RO: m.offsets("q", mo), _RS: m.offsets("q", c.hq)}


def ragged_fwd(c: _Call, q, k, v, m: _Meta):
    spec = c.spec(q.dtype, q.device, m.nb, backward=False)
    g = _graph(spec)
    o_shape = (c.tq, c.hq, c.dv) if c.layout == "thd" else (c.hq, c.tq, c.dv)
    out = _outputs.empty(o_shape, q.dtype, q.device)
    stats = torch.empty((c.tq, c.hq), dtype=torch.float32, device=q.device)
    if c.tq and c.tk:
        bufs = {_Q: q, _K: k, _V: v, _O: out, _STATS: stats, **_meta_buffers(c, m)}
        _execute(g, bufs, q.device)
    _fix_rows(out, m.empty_q, c.layout, 0.0)
    return out, stats


def ragged_bwd(c: _Call, q, k, v, out, stats, dout, m: _Meta):
    spec = c.spec(q.dtype, q.device, m.nb, backward=True)
    g = _graph(spec)
    dq, dk, dv = (_outputs.empty(t.shape, t.dtype, t.device) for t in (q, k, v))
    if c.tq and c.tk:
        bufs = {_Q: q, _K: k, _V: v, _O: out, _DO: dout, _STATS: stats, _DQ: dq, _DK: dk, _DV: dv,
                **_meta_buffers(c, m)}
        _execute(g, bufs, q.device)
    else:
        for t in (dq, dk, dv):
            t.zero_()
        return dq, dk, dv
    _fix_rows(dq, m.empty_q, c.layout, 0.0)
    _fix_rows(dk, m.dead_k, c.layout, 0.0)
    _fix_rows(dv, m.dead_k, c.layout, 0.0)
    return dq, dk, dv


class CudnnVarlenFunction(torch.autograd.Function):
    """cuDNN ragged attention: forward and backward graphs; returns (out, stats (Tq, Hq))."""

    @staticmethod
    def forward(ctx, q, k, v, c: _Call, m: _Meta):
        out, stats = ragged_fwd(c, q, k, v, m)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.c, ctx.m = c, m
        ctx.mark_non_differentiable(stats)
        return out, stats

    @staticmethod
    def backward(ctx, dout, _dstats):
        q, k, v, out, stats = ctx.saved_tensors
        dq, dk, dv = ragged_bwd(ctx.c, q, k, v, out, stats, _packed(dout, ctx.c.layout), ctx.m)
        return dq, dk, dv, None, None


def _lse_from_stats(stats: torch.Tensor, m: _Meta) -> torch.Tensor:
    """(Hq, Tq) lse: a view of the (Tq, Hq) statistics, or a copy with +inf on rows that see no key."""
    lse = stats.t()
    if m.empty_q is not None:
        lse = torch.where(m.empty_q[None, :], float("inf"), lse)
    return lse


_htd_totals: Dict[tuple, set] = {}


def _htd_as_thd(c: "_Call", dtype, device, nb) -> bool:
    """Whether an "htd" call goes through a transposed copy (see HTD_MAX_TOTALS)."""
    if c.spec(dtype, device, nb, False) in _graphs:
        return False
    sig = (c.hq, c.hk, c.d, c.dv, c.window, c.scale, dtype, device)
    seen = _htd_totals.setdefault(sig, set())
    seen.add((c.tq, c.tk))
    return len(seen) > HTD_MAX_TOTALS


def _ragged(a: AttnArgs):
    vl = a.varlen
    layout = vl.layout
    hq, hk = a.heads
    tdim = _token_dim(layout)
    equal = vl.cu_seqlens_q is vl.cu_seqlens_k
    c = _Call(layout, hq, hk, a.q.shape[-1], a.v.shape[-1], a.q.shape[tdim], a.k.shape[tdim], vl.max_seqlen_q,
              vl.max_seqlen_k, a.softmax_scale, a.window, a.deterministic, equal)
    nb = bucket_batch(vl.num_seqs)
    q, k, v = a.q, a.k, a.v
    # "htd" runs through a transposed "thd" copy past HTD_MAX_TOTALS graphs, and always for GQA with a backward:
    # cuDNN's htd backward gave wrong dK / dV for GQA (4 of 15 seeds of the GPU property suite, errors up to 60;
    # thd 0 of 21), see docs/DISPATCH.md
    transposed = layout == "htd" and ((hq != hk and a.needs_grad()) or _htd_as_thd(c, q.dtype, q.device, nb))
    if transposed:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        c = _Call("thd", *[getattr(c, f) for f in ("hq", "hk", "d", "dv", "tq", "tk", "max_sq", "max_sk", "scale",
                                                   "window", "deterministic", "equal_lengths")])
    q, k, v = (_packed(t, c.layout) for t in (q, k, v))
    m = _prepare(vl.cu_seqlens_q, vl.cu_seqlens_k, c.tq, c.tk, a.window[1], nb, None)
    out, stats = CudnnVarlenFunction.apply(q, k, v, c, m)
    return (out.transpose(0, 1) if transposed else out), _lse_from_stats(stats, m)


_dense_cu: Dict[tuple, torch.Tensor] = {}


def _dense_graph(a: AttnArgs):
    """A dense call as a ragged call with equal lengths: (B, S, H, D) is packed (B*S, H, D)."""
    b, sq, hq, d = a.q.shape
    sk, hk = a.k.shape[1], a.k.shape[2]
    dev = a.q.device

    def cu(s):
        key = (dev, b, s)
        t = _dense_cu.get(key)
        if t is None:
            t = _dense_cu[key] = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
        return t

    q = _packed(a.q, "thd").view(b * sq, hq, d)
    k = _packed(a.k, "thd").view(b * sk, hk, d)
    v = _packed(a.v, "thd").view(b * sk, hk, a.v.shape[-1])
    wl, wr = a.window
    shift = sq if sk == 0 else (max(0, min(sq, sq - sk - wr)) if wr >= 0 else 0)
    c = _Call("thd", hq, hk, d, v.shape[-1], b * sq, b * sk, sq, sk, a.softmax_scale, a.window, a.deterministic,
              sq == sk)
    m = _prepare(cu(sq), cu(sk), c.tq, c.tk, wr, bucket_batch(b), shift)
    out, stats = CudnnVarlenFunction.apply(q, k, v, c, m)
    lse = _lse_from_stats(stats, m).view(hq, b, sq).permute(1, 0, 2)
    return out.view(b, sq, hq, -1), lse


def attention(a: "AttnArgs"):
    """``backend="cudnn"`` implementation of flash / flash_varlen."""
    a, done = prepare(a)          # scale > 0 (cuDNN masks with -inf before it scales); no rows / no keys
    if done is not None:
        return done
    if a.varlen is not None:
        return _ragged(a)
    if dense_needs_graph(a.call().features):
        return _dense_graph(a)
    return _dense_sdpa_cudnn(a)


from .api import AttnArgs  # noqa: E402  (type used above; api imports this module at its end)
from .contract import prepare  # noqa: E402
