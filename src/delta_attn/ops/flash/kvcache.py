"""``flash_attn_with_kvcache`` (flash-attn 2's decode entry point): validation, the :class:`KVCacheArgs`
handed to backends, the public wrapper and its capability registrations.

Backends receive one validated :class:`KVCacheArgs` and return ``(out (B, Sq, Hq, D), lse (B, Hq, Sq)
float32)``, having written the new keys / values into the caches in place. Inference only.

Value checks (cache lengths, left padding, cache rows, block-table entries, rotary table length) read
device tensors on the host once per call; they are skipped while a CUDA graph is captured or
``torch.compile`` traces (``_checks.value_checks_enabled``): the caller then vouches for the values, and a
block index out of range reads or writes outside the cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ... import _checks as C
from ... import _install
from ...backends import Call, Capability, explain_call, register, select
from .api import _common, _triton_head_dims

SHAPES = ("q (B, Sq, Hq, D); k_cache / v_cache (B_cache, S_cache, Hk, D), or (num_blocks, page_size, Hk, D) "
          "with block_table (B, max_blocks)")


@dataclass(frozen=True)
class KVCacheArgs:
    """A validated call. ``window`` folds ``causal`` in (right bound 0) and, as flash-attn, counts a bound
    at least the cache capacity as unbounded; ``cache_seqlens`` is always a (B,) int32 tensor."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    rotary_cos: Optional[torch.Tensor]
    rotary_sin: Optional[torch.Tensor]
    cache_seqlens: torch.Tensor
    cache_batch_idx: Optional[torch.Tensor]
    cache_leftpad: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    softmax_scale: float
    causal: bool
    window: Tuple[int, int]
    softcap: float
    rotary_interleaved: bool
    alibi_slopes: Optional[torch.Tensor]
    num_splits: int
    return_lse: bool

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def capacity(self) -> int:
        """Cache positions one sequence can hold."""
        if self.paged:
            return self.block_table.shape[1] * self.k_cache.shape[1]
        return self.k_cache.shape[1]

    @property
    def rotary_per_query(self) -> bool:
        """Query i is rotated at position cache_seqlens + i (causal or windowed); else all at cache_seqlens."""
        return self.window != (-1, -1)

    def call(self) -> Call:
        feats = {name for name, used in (
            ("causal", self.causal), ("window", self.window != ((-1, 0) if self.causal else (-1, -1))),
            ("softcap", self.softcap > 0), ("alibi", self.alibi_slopes is not None),
            ("gqa", self.q.shape[2] != self.k_cache.shape[2]), ("paged", self.paged),
            ("new_kv", self.k is not None), ("rotary", self.rotary_cos is not None),
            ("cache_batch_idx", self.cache_batch_idx is not None), ("leftpad", self.cache_leftpad is not None),
        ) if used}
        tensors = (self.q, self.k_cache, self.v_cache, self.k, self.v)
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
        return Call(op="flash_kvcache", device=self.q.device, dtype=self.q.dtype,
                    head_dims=(self.q.shape[-1], self.v_cache.shape[-1]), features=frozenset(feats),
                    needs_grad=needs_grad)


def _index(name: str, x, shape: Tuple[int, ...], doc: str, device: torch.device) -> None:
    """An optional int32 / int64 index tensor of ``shape`` on ``device`` (validate makes it contiguous int32)."""
    if x is None:
        return
    C.tensor(name, x, len(shape), C.INDEX_DTYPES, doc)
    C.shape_equal(name, x, shape, doc)
    if x.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}), got {x.device}")


def _value_checks(a: KVCacheArgs, snew: int, b_cache: int) -> None:
    """Every check that reads device values, with one device-to-host copy (plus one more to name the
    offending row when a check fails)."""
    # as few device ops as the call's options need (each is a launch on a GPU); sums of a device value and a
    # host number are taken on the host
    n = a.cache_seqlens.long()
    stats = list(torch.aminmax(n))
    lp = None
    if a.cache_leftpad is not None:
        lp = a.cache_leftpad.long()
        stats += [lp.min(), (lp - n).max()]
    if a.cache_batch_idx is not None:
        idx = a.cache_batch_idx.long()
        ordered = idx.sort().values
        stats += [ordered[0], ordered[-1], (ordered[1:] == ordered[:-1]).any().long()]
    if a.paged:
        page = a.k_cache.shape[1]
        used = torch.arange(a.block_table.shape[1], device=n.device)[None, :] < (n[:, None] + (snew + page - 1)) // page
        bt = a.block_table.long()
        bad_blocks = used & ((bt < 0) | (bt >= a.k_cache.shape[0]))
        stats.append(bad_blocks.any().long())
    vals = torch.stack(stats).tolist()
    n_min, total_max = vals[0], vals[1] + snew
    rest = vals[2:]
    if n_min < 0:
        raise ValueError(f"cache_seqlens must be >= 0 (tokens already in the cache), got {n_min}")
    if total_max > a.capacity:
        row = int(n.argmax())
        where = (f"block_table.shape[1] * page_size = {a.block_table.shape[1]} * {a.k_cache.shape[1]}" if a.paged
                 else "k_cache.shape[1]")
        raise ValueError(f"the cache is too short: cache_seqlens + new tokens (k.shape[1] = {snew}) must be <= "
                         f"{a.capacity} ({where}), got {total_max} for batch row {row}")
    if lp is not None:
        lp_min, lp_over = rest[:2]
        rest = rest[2:]
        if lp_min < 0 or lp_over > 0:
            row = int(((lp < 0) | (lp > n)).long().argmax())
            raise ValueError(f"cache_leftpad must lie in [0, cache_seqlens] for every row, got {int(lp[row])} with "
                             f"cache_seqlens {int(n[row])} for batch row {row}")
    if a.cache_batch_idx is not None:
        lo, hi, repeats = rest[:3]
        rest = rest[3:]
        if lo < 0 or hi >= b_cache:
            raise ValueError(f"cache_batch_idx must lie in [0, {b_cache}) (rows of k_cache), got values from {lo} "
                             f"to {hi}")
        if repeats and a.k is not None:
            raise ValueError("cache_batch_idx must not repeat a cache row when k / v are appended: two batch rows "
                             "would write the same cache positions")
    if a.paged:
        if rest[0]:
            r, col = (int(x) for x in bad_blocks.nonzero()[0].tolist())
            raise ValueError(f"block_table entries must lie in [0, {a.k_cache.shape[0]}) (blocks of k_cache) for the "
                             f"pages a sequence uses, got {int(a.block_table[r, col])} at block_table[{r}, {col}]")
    if a.rotary_cos is not None:
        needed = vals[1] + max(snew, a.q.shape[1] if a.rotary_per_query else 1)
        if needed > a.rotary_cos.shape[0]:
            raise ValueError(f"rotary_cos / rotary_sin must cover every rotated position: positions up to "
                             f"{needed - 1} are needed (cache_seqlens + new tokens), got {a.rotary_cos.shape[0]} rows")


def _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
           block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
           return_softmax_lse) -> Tuple[float, bool, Tuple[int, int], float]:
    """Every check that reads no device value. Returns (softmax_scale, causal, window, softcap) normalised."""
    C.tensor("q", q, 4, shape_doc="(batch, seqlen_q, heads_q, head_dim)")
    paged = block_table is not None
    cache_doc = "(num_blocks, page_size, heads_k, head_dim)" if paged else "(batch_cache, seqlen_cache, heads_k, head_dim)"
    C.tensor("k_cache", k_cache, 4, shape_doc=cache_doc)
    C.tensor("v_cache", v_cache, 4, shape_doc=cache_doc)
    for name, t in (("k", k), ("v", v)):
        if t is not None:
            C.tensor(name, t, 4, shape_doc="(batch, seqlen_new, heads_k, head_dim)")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t is not None:
            C.tensor(name, t, 2, (q.dtype, torch.float32), "(seqlen_ro, rotary_dim / 2)")
    if alibi_slopes is not None:
        C.tensor("alibi_slopes", alibi_slopes, None, (torch.float32,), "(H,) or (B, H) float32")
    C.same_dtype(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    device = C.same_device(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos,
                           rotary_sin=rotary_sin, alibi_slopes=alibi_slopes)
    b, sq, hq, d = q.shape
    hk = k_cache.shape[2]
    C.shape_equal("v_cache", v_cache, tuple(k_cache.shape), "(the shape of k_cache)")
    C.dim_equal("head dim", "k_cache", k_cache.shape[3], "q", d)
    C.positive_dim("k_cache heads", hk)
    C.heads_divide("q heads", hq, "k_cache heads", hk)
    C.positive_dim("k_cache page size" if paged else "k_cache length (S_cache)", k_cache.shape[1])
    C.flag("return_softmax_lse", return_softmax_lse)
    C.flag("rotary_interleaved", rotary_interleaved)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen from the shapes), got {num_splits!r}")
    # new keys / values
    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together (new keys and values), got k={'a tensor' if k is not None else None} "
                         f"and v={'a tensor' if v is not None else None}")
    snew = 0
    if k is not None:
        snew = k.shape[1]
        C.shape_equal("k", k, (b, snew, hk, d), "(batch of q, seqlen_new, heads of k_cache, head dim)")
        C.shape_equal("v", v, tuple(k.shape), "(the shape of k)")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when k / v are given: it says where to write them")
    # where each batch row's cache lives
    b_cache = k_cache.shape[0]
    if paged:
        C.tensor("block_table", block_table, 2, C.INDEX_DTYPES, "(batch, max_blocks_per_seq) int32")
        C.dim_equal("batch size", "block_table", block_table.shape[0], "q", b)
        C.positive_dim("block_table.shape[1] (blocks per sequence)", block_table.shape[1])
        if block_table.device != device:
            raise ValueError(f"block_table must be on the device of q ({device}), got {block_table.device}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx must be None with a paged cache (block_table): block_table already maps "
                             "each batch row to its pages")
    elif cache_batch_idx is None and b_cache != b:
        raise ValueError(f"k_cache batch size must equal q's ({b}) when cache_batch_idx is None, got {b_cache}")
    _index("cache_batch_idx", cache_batch_idx, (b,), "(batch,) int32", device)
    _index("cache_leftpad", cache_leftpad, (b,), "(batch,) int32", device)
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if cache_seqlens is None:
        cache_seqlens = capacity
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens must be an int or a (batch,) int32 tensor, got {type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= capacity - snew:
            raise ValueError(f"the cache is too short: cache_seqlens + new tokens (k.shape[1] = {snew}) must be <= "
                             f"{capacity} (the cache capacity per sequence), and cache_seqlens >= 0, got "
                             f"cache_seqlens = {cache_seqlens}")
    else:
        _index("cache_seqlens", cache_seqlens, (b,), "(batch,) int32", device)
    # rotary
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos / rotary_sin need k / v: the rotary embedding is applied to the new keys "
                             "(and to q) at positions cache_seqlens, cache_seqlens + 1, ...")
        C.shape_equal("rotary_sin", rotary_sin, tuple(rotary_cos.shape), "(the shape of rotary_cos)")
        if rotary_cos.shape[1] == 0 or 2 * rotary_cos.shape[1] > d:
            raise ValueError(f"rotary_cos.shape[1] (rotary_dim / 2) must be in [1, {d // 2}] (head dim {d}), "
                             f"got {rotary_cos.shape[1]}")
    common = _common(q, k_cache, v_cache, hq, hk, b, 0.0, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, False, return_softmax_lse)
    # as flash-attn: a window bound reaching past the whole cache bounds nothing
    wl, wr = (w if w < capacity else -1 for w in common["window"])
    return common["softmax_scale"], common["causal"], (wl, wr), common["softcap"]


def validate(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
             cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
             window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
             return_softmax_lse=False) -> KVCacheArgs:
    # shapes, dtypes, devices, options: once per signature (C.memoized); device values: every call
    softmax_scale, causal, window, softcap = C.memoized(
        "flash_kvcache", _check, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
        num_splits, return_softmax_lse)
    b = q.shape[0]
    if cache_seqlens is None:        # the whole cache
        cache_seqlens = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table = map(
        C.as_int32, (cache_seqlens, cache_batch_idx, cache_leftpad, block_table))
    a = KVCacheArgs(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                    cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                    block_table=block_table, softmax_scale=softmax_scale, causal=causal, window=window,
                    softcap=softcap, rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
                    num_splits=num_splits, return_lse=return_softmax_lse)
    if b > 0 and C.value_checks_enabled():
        _value_checks(a, 0 if k is None else k.shape[1], k_cache.shape[0])
    return a


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, backend="auto"):
    """Attention of new queries over a KV cache, with the new keys / values appended in place
    (flash-attn 2's ``flash_attn_with_kvcache``; inference only).

    q (B, Sq, Hq, D); caches (B_cache, S_cache, Hk, D), or paged (num_blocks, page_size, Hk, D) with
    ``block_table`` (B, max_blocks) int32; ``k`` / ``v`` (B, Snew, Hk, D) are written at positions
    ``cache_seqlens[b] ..`` (int or (B,) int32: tokens already cached; None: the whole cache, no k / v)
    of cache row ``cache_batch_idx[b]``. The queries then attend to cache positions
    ``cache_leftpad[b] .. cache_seqlens[b] + Snew - 1``, causal / window aligned bottom-right. With
    ``rotary_cos`` / ``rotary_sin`` (seqlen_ro, rotary_dim / 2), k is rotated at its positions, and q at
    ``cache_seqlens + i`` (causal or windowed) or ``cache_seqlens`` (otherwise); ``rotary_interleaved``
    pairs channels (2i, 2i + 1), else (i, i + rotary_dim / 2). ``num_splits`` splits the keys of one
    sequence over that many programs (0: chosen from the shapes). Returns out (B, Sq, Hq, D), or
    ``(out, softmax_lse (B, Hq, Sq) float32)`` when ``return_softmax_lse``; a query that sees no key
    gets zeros and lse = +inf. Under CUDA-graph capture the value checks are skipped (module docstring).

    >>> import torch, delta_attn as da
    >>> k_cache = torch.zeros(2, 16, 1, 8); v_cache = torch.zeros(2, 16, 1, 8)     # 4 q heads over 1 kv head
    >>> q, (k, v) = torch.randn(2, 1, 4, 8), torch.randn(2, 2, 1, 1, 8).unbind(0)
    >>> out = da.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=5, causal=True,
    ...                                  backend="torch")
    >>> out.shape, bool((k_cache[:, 5] == k[:, 0]).all())
    (torch.Size([2, 1, 4, 8]), True)
    """
    args = validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                    num_splits, return_softmax_lse)
    out, lse = select(args.call(), backend)(args)
    return (out, lse) if args.return_lse else out


flash_attn_with_kvcache.plan = lambda *a, backend="auto", **kw: explain_call(validate(*a, **kw).call(), backend)

FEATURES = frozenset({"causal", "window", "softcap", "alibi", "gqa", "paged", "new_kv", "rotary", "cache_batch_idx",
                      "leftpad"})
register("torch", "flash_kvcache", Capability(
    impl="delta_attn.ops.flash.torch_impl:kvcache", device_types=("cpu", "cuda", "mps", "xpu"),
    dtypes=C.FLOAT_DTYPES, features=FEATURES, backward=False))
register("triton", "flash_kvcache", Capability(
    impl="delta_attn.ops.flash.decode:kvcache", device_types=("cuda", "cpu"),
    dtypes=(torch.float16, torch.bfloat16, torch.float32), features=FEATURES, backward=False,
    head_dims=_triton_head_dims, requires=("triton",), install_hint=_install.TRITON))
