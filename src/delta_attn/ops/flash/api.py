"""Public flash-attention entry points (flash-attn 2 API) and their validation.

Backends receive one normalised :class:`AttnArgs` and return ``(out, lse)``: out in the layout of
q, lse float32 (B, Hq, Sq) dense or (Hq, total_q) varlen.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ... import _checks as C
from ... import _install
from ...backends import Call, Capability, register, select, explain_call

LAYOUTS = ("thd", "htd")


@dataclass(frozen=True)
class Varlen:
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    layout: str               # "thd": (total, H, D); "htd": (H, total, D)
    num_seqs: int


@dataclass(frozen=True)
class AttnArgs:
    """A validated attention call. ``window`` already folds ``causal`` in (right bound 0)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    softmax_scale: float
    causal: bool
    window: Tuple[int, int]
    softcap: float
    alibi_slopes: Optional[torch.Tensor]
    dropout_p: float
    deterministic: bool
    return_lse: bool
    varlen: Optional[Varlen] = None

    @property
    def heads(self) -> Tuple[int, int]:
        """(Hq, Hk)"""
        if self.varlen is not None and self.varlen.layout == "htd":
            return self.q.shape[0], self.k.shape[0]
        return self.q.shape[-2], self.k.shape[-2]

    def call(self) -> Call:
        hq, hk = self.heads
        feats = set()
        if self.causal:
            feats.add("causal")
        if self.window != ((-1, 0) if self.causal else (-1, -1)):
            feats.add("window")
        if self.softcap > 0:
            feats.add("softcap")
        if self.alibi_slopes is not None:
            feats.add("alibi")
        if self.dropout_p > 0:
            feats.add("dropout")
        if hq != hk:
            feats.add("gqa")
        if self.deterministic:
            feats.add("deterministic")
        if self.k.shape[-1] != self.v.shape[-1]:
            feats.add("head_dim_v")
        if self.varlen is not None:
            feats.add("varlen")
            if self.varlen.layout == "htd":
                feats.add("layout_htd")
        else:
            if self.q.shape[1] != self.k.shape[1]:
                feats.add("sq_ne_sk")
            if self.q.shape[1] == self.k.shape[1] == 1:
                feats.add("single_token")       # Sq = Sk = 1 (PyTorch's cuDNN SDPA refuses it)
        return Call(op="flash_varlen" if self.varlen is not None else "flash", device=self.q.device,
                    dtype=self.q.dtype, head_dims=(self.q.shape[-1], self.v.shape[-1]),
                    features=frozenset(feats), needs_grad=self.needs_grad())

    def needs_grad(self) -> bool:
        """Grad mode on and q, k or v requires grad (the backward follows)."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.v))


def _common(q, k, v, hq, hk, batch, dropout_p, softmax_scale, causal, window_size, softcap,
            alibi_slopes, deterministic, return_attn_probs) -> dict:
    C.same_dtype(q=q, k=k, v=v)
    C.same_device(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
    d = q.shape[-1]
    C.positive_dim("q head dim", d)
    C.dim_equal("head dim", "k", k.shape[-1], "q", d)
    C.positive_dim("v head dim", v.shape[-1])
    C.positive_dim("q heads", hq)
    C.heads_divide("q heads", hq, "k heads", hk)
    dropout_p = C.number("dropout_p", dropout_p, 0.0, 1.0, high_inclusive=False)
    softcap = C.number("softcap", softcap, 0.0, doc=">= 0 (0 disables it)", finite=True)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    softmax_scale = C.number("softmax_scale", softmax_scale, finite=True)     # any finite scale, negative too
    causal = C.flag("causal", causal)
    C.flag("deterministic", deterministic)
    C.flag("return_attn_probs", return_attn_probs)
    wl, wr = C.window(window_size)
    if causal:
        wr = 0
    if alibi_slopes is not None:
        C.tensor("alibi_slopes", alibi_slopes, None, (torch.float32,), "(H,) or (B, H) float32")
        if tuple(alibi_slopes.shape) not in ((hq,), (batch, hq)):
            raise ValueError(f"alibi_slopes must have shape ({hq},) or ({batch}, {hq}) (heads of q), "
                             f"got {tuple(alibi_slopes.shape)}")
    return dict(softmax_scale=softmax_scale, causal=causal, window=(wl, wr), softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
                return_lse=return_attn_probs)


def validate_dense(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                   softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False) -> AttnArgs:
    C.tensor("q", q, 4, shape_doc="(batch, seqlen_q, heads_q, head_dim)")
    C.tensor("k", k, 4, shape_doc="(batch, seqlen_k, heads_k, head_dim)")
    C.tensor("v", v, 4, shape_doc="(batch, seqlen_k, heads_k, head_dim_v)")
    C.dim_equal("batch size", "k", k.shape[0], "q", q.shape[0])
    C.dim_equal("batch size", "v", v.shape[0], "q", q.shape[0])
    C.dim_equal("sequence length", "v", v.shape[1], "k", k.shape[1])
    C.dim_equal("heads", "v", v.shape[2], "k", k.shape[2])
    common = _common(q, k, v, q.shape[2], k.shape[2], q.shape[0], dropout_p, softmax_scale, causal,
                     window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    return AttnArgs(q=q, k=k, v=v, **common)


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False, layout="thd") -> AttnArgs:
    C.one_of("layout", layout, LAYOUTS)
    doc = "(total, heads, head_dim)" if layout == "thd" else "(heads, total, head_dim)"
    C.tensor("q", q, 3, shape_doc=doc)
    C.tensor("k", k, 3, shape_doc=doc)
    C.tensor("v", v, 3, shape_doc=doc)
    tdim, hdim = (0, 1) if layout == "thd" else (1, 0)
    C.dim_equal("token count", "v", v.shape[tdim], "k", k.shape[tdim])
    C.dim_equal("heads", "v", v.shape[hdim], "k", k.shape[hdim])
    device = C.same_device(q=q, k=k, v=v)            # before cu_seqlens, which must be on this device
    cu_seqlens_q, cu_seqlens_k, n = C.cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, q.shape[tdim], k.shape[tdim],
                                                      max_seqlen_q, max_seqlen_k, device)   # int32, contiguous
    common = _common(q, k, v, q.shape[hdim], k.shape[hdim], n, dropout_p, softmax_scale, causal,
                     window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), layout, n)
    return AttnArgs(q=q, k=k, v=v, varlen=varlen, **common)


def _finish(args: AttnArgs, out_lse):
    out, lse = out_lse
    return (out, lse, None) if args.return_lse else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    backend="auto"):
    """Attention over dense batches, flash-attn 2 compatible.

    q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv), Hq % Hk == 0 (GQA / MQA).
    Returns out (B, Sq, Hq, Dv), or ``(out, softmax_lse (B, Hq, Sq) float32, None)`` when
    ``return_attn_probs``. ``causal`` is aligned bottom-right; ``window_size=(left, right)``, -1
    unbounded; ``softcap > 0`` caps scores with ``softcap * tanh(s / softcap)``; ``alibi_slopes``
    (Hq,) or (B, Hq) float32 subtract ``slope * |i + Sk - Sq - j|``. A query row that sees no key
    returns zeros (lse = +inf).

    >>> import torch, delta_attn as da
    >>> q = k = v = torch.randn(1, 5, 2, 16)
    >>> da.flash_attn_func(q, k, v, causal=True, backend="torch").shape
    torch.Size([1, 5, 2, 16])
    """
    args = validate_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          deterministic, return_attn_probs)
    return _finish(args, select(args.call(), backend)(args))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                           layout="thd", backend="auto"):
    """Attention over a packed batch of sequences of different lengths.

    ``layout="thd"``: q (total_q, Hq, D), k/v (total_k, Hk, D) as flash-attn; ``"htd"``: (H, total, D).
    ``cu_seqlens_q/k`` int32 or int64 (N + 1,) cumulative lengths starting at 0. Returns out in q's layout,
    or ``(out, softmax_lse (Hq, total_q), None)`` when ``return_attn_probs``.

    >>> import torch, delta_attn as da
    >>> q = k = v = torch.randn(7, 2, 16)
    >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    >>> da.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True, backend="torch").shape
    torch.Size([7, 2, 16])
    """
    args = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                           softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs, layout)
    return _finish(args, select(args.call(), backend)(args))


def plan_dense(*a, backend="auto", **kw):
    return explain_call(validate_dense(*a, **kw).call(), backend)


def plan_varlen(*a, backend="auto", layout="thd", **kw):
    return explain_call(validate_varlen(*a, layout=layout, **kw).call(), backend)


flash_attn_func.plan = plan_dense
flash_attn_varlen_func.plan = plan_varlen

# ---------------------------------------------------------------------------------------------
# the torch backend: the reference, any device and dtype, every feature
# ---------------------------------------------------------------------------------------------
ALL_FEATURES = frozenset({"causal", "window", "softcap", "alibi", "dropout", "gqa", "deterministic",
                          "head_dim_v", "varlen", "layout_htd", "sq_ne_sk", "single_token"})
_ANY = dict(device_types=("cpu", "cuda", "mps", "xpu"), dtypes=C.FLOAT_DTYPES, features=ALL_FEATURES)
register("torch", "flash", Capability(impl="delta_attn.ops.flash.torch_impl:attention", **_ANY))
register("torch", "flash_varlen", Capability(impl="delta_attn.ops.flash.torch_impl:attention", **_ANY))

# ---------------------------------------------------------------------------------------------
# the triton backend: delta-attn's kernels (ops/flash/kernels_*.py), fp16/bf16, forward + backward
# ---------------------------------------------------------------------------------------------


def _triton_head_dims(dims) -> Optional[str]:
    d, dv = dims[0], dims[-1]
    if d != dv:
        return f"needs the same head dim for q/k and v, got {d} and {dv}"
    if d % 8 or not 8 <= d <= 256:
        return f"supports head dims that are multiples of 8 from 8 to 256, got {d}"
    return None


_TRITON = dict(device_types=("cuda",), dtypes=(torch.float16, torch.bfloat16), head_dims=_triton_head_dims,
               features=ALL_FEATURES - {"head_dim_v"}, requires=("triton",), install_hint=_install.TRITON)
register("triton", "flash", Capability(impl="delta_attn.ops.flash.triton_impl:attention", **_TRITON))
register("triton", "flash_varlen", Capability(impl="delta_attn.ops.flash.triton_impl:attention", **_TRITON))

# backend="cudnn" (and the attention auto policy) and backend="sdpa": each module registers itself; neither
# imports its optional package (cudnn-frontend) before a call runs
from . import cudnn as _cudnn, sdpa as _sdpa  # noqa: E402,F401
