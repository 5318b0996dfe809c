"""Every implementation the benchmark can time: delta-attn's backends and the peers.

An :class:`Impl` says whether it can run a case (``why_not`` -> a reason or None) and binds the
case's canonical inputs (:mod:`.cases`) to a :class:`Bound`: ``fn()`` runs the operator once and
returns the tensor to check / backpropagate; ``leaves`` get the gradients; ``spec(leaves, upcast)``
is the same computation done by ``delta_attn.reference`` (the correctness gate runs it in float64
and in the input dtype). Peers are discovered at run time; nothing optional is imported here at
module import time.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import delta_attn as da
from delta_attn import _install
from delta_attn import reference
from delta_attn.backends import BACKENDS, package_available

FLA_HINT = f"not installed: {_install.FLA}"


@dataclass
class Bound:
    fn: Callable[[], torch.Tensor]
    leaves: List[torch.Tensor]
    spec: Callable[[List[torch.Tensor], bool], torch.Tensor]
    post: Callable[[torch.Tensor], torch.Tensor] = lambda t: t      # output -> what is checked (gate only)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    inputs: List[torch.Tensor] = field(default_factory=list)         # everything read (byte model)


@dataclass
class Impl:
    name: str
    op: str                    # flash | flash_varlen | kda | diag | {flash, kvcache, kda, diag}_decode
    family: str                # quadratic | linear
    provider: str              # delta-attn | torch | fla-core
    bind: Callable[[Dict, Dict], Bound]
    why_not: Callable[[Dict, torch.device, torch.dtype, bool], Optional[str]]
    backward: bool = True

    @property
    def ours(self) -> bool:
        return self.provider == "delta-attn"


def _leaf(t: torch.Tensor, grad: bool = True) -> torch.Tensor:
    return t.detach().clone().requires_grad_(grad and t.is_floating_point())


# ---------------------------------------------------------------------------------------------
# delta-attn: one implementation per registered backend, reasons from the registry
# ---------------------------------------------------------------------------------------------

_PUBLIC = {"flash": "flash_attn_func", "flash_varlen": "flash_attn_varlen_func", "kda": "kda",
           "diag": "gated_diag_attn", "flash_decode": "flash_attn_func", "kvcache_decode": "flash_attn_with_kvcache",
           "kda_decode": "kda_step", "diag_decode": "gated_diag_step"}
_REGISTRY_OP = {"flash": "flash", "flash_varlen": "flash_varlen", "kda": "kda", "diag": "diag",
                "flash_decode": "flash", "kvcache_decode": "flash_kvcache", "kda_decode": "kda_step",
                "diag_decode": "diag_step"}
QUADRATIC_OPS = ("flash", "flash_varlen", "flash_decode", "kvcache_decode")


def _probe_args(op: str, case: Dict, device: torch.device, dtype: torch.dtype, grad: bool):
    """Tiny tensors with the case's dtype, head dims and options: enough for the registry's reasons."""
    from . import cases
    small = cases.probe_case(case, tiny=True)
    inp = cases.make_inputs(small, device, dtype, seed=0)
    return _call_args(op, small, {k: (_leaf(v, grad) if k in cases.GRAD_INPUTS.get(op, ()) else v)
                                  for k, v in inp.items()})


def _call_args(op: str, case: Dict, t: Dict):
    """(args, kwargs) of the public delta-attn call for ``op`` on inputs ``t``."""
    if op in ("flash", "flash_decode"):
        return (t["q"], t["k"], t["v"]), dict(causal=case.get("causal", True))
    if op == "flash_varlen":
        cu, mx = t["cu_seqlens"], case["max_seqlen"]
        return (t["q"], t["k"], t["v"], cu, cu, mx, mx), dict(causal=case.get("causal", True))
    if op == "kvcache_decode":
        return (t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"]), dict(
            cache_seqlens=t["cache_seqlens"], block_table=t.get("block_table"), causal=True)
    if op == "kda":
        return (t["q"], t["k"], t["v"], t["g"], t["beta"]), dict(use_qk_l2norm=True)
    if op == "diag":
        return (t["q"], t["k"], t["v"], t["g"]), {}
    if op == "kda_decode":
        return (t["q"], t["k"], t["v"], t["g"], t["beta"], t["state"]), dict(use_qk_l2norm=True)
    if op == "diag_decode":
        return (t["q"], t["k"], t["v"], t["g"], t["state"]), {}
    raise ValueError(op)


def _prenormed(args, kw):
    """The kda call with q and k L2-normalised by the caller (``use_qk_l2norm=False``): how the cuDNN KDA
    backward must be called. Normalising inside the timed function keeps the row's work the same."""
    from ..ops.kda.cudnn import prenorm
    return (prenorm(args[0]), prenorm(args[1])) + tuple(args[2:]), dict(kw, use_qk_l2norm=False)


def _ours_why_not(backend: str, op: str, prenormed: bool = False):
    def why(case, device, dtype, grad):
        try:
            args, kw = _probe_args(op, case, device, dtype, grad)
            if prenormed:
                args, kw = _prenormed(args, kw)
            with torch.set_grad_enabled(grad):
                ex = da.explain(_PUBLIC[op], *args, backend=backend, **kw)
        except (ValueError, TypeError) as e:
            return f"invalid call: {e}"
        reasons = ex.considered[0][1] if ex.considered else ["not registered"]
        return "; ".join(reasons) if reasons else None
    return why


def _ours_bind(backend: str, op: str, prenormed: bool = False):
    from . import cases
    fn_pub = getattr(da, _PUBLIC[op])

    def bind(case, t):
        grad_names = cases.GRAD_INPUTS.get(op, ())
        t = {k: (_leaf(v) if k in grad_names else v) for k, v in t.items()}
        args, kw = _call_args(op, case, t)
        leaves = [t[k] for k in cases.SPEC_INPUTS[op]]
        if prenormed:
            def fn():
                pargs, pkw = _prenormed(args, kw)
                return fn_pub(*pargs, backend=backend, **pkw)[0]
        elif op in ("kda", "diag"):
            fn = lambda: fn_pub(*args, backend=backend, **kw)[0]
        else:
            fn = lambda: fn_pub(*args, backend=backend, **kw)
        return Bound(fn=fn, leaves=leaves, spec=cases.spec(op, case, t), inputs=list(args))
    return bind


def ours(op: str, device: torch.device) -> List[Impl]:
    reg = _REGISTRY_OP[op]
    out = []
    for name, backend in BACKENDS.items():
        if reg not in backend.capabilities:
            continue
        if name == "torch" and device.type == "cuda":
            continue            # the reference path is a specification, not a kernel: not timed on GPUs
        family = "quadratic" if op in QUADRATIC_OPS else "linear"
        # cuDNN's KDA is NVIDIA's engine behind delta-attn's adapter: a peer in the ratios, not our kernel
        provider = "nvidia-cudnn-frontend" if (name == "cudnn" and op.startswith("kda")) else "delta-attn"
        out.append(Impl(name=f"delta-attn {name}", op=op, family=family, provider=provider,
                        bind=_ours_bind(name, op), why_not=_ours_why_not(name, op),
                        backward=backend.capabilities[reg].backward and not op.endswith("decode")))
    if op == "kda" and "kda" in BACKENDS["cudnn"].capabilities:
        # cuDNN's KDA backward takes q/k normalised by the caller: this row does that in PyTorch (timed with it)
        out.append(Impl(name="delta-attn cudnn (q/k normed in torch)", op=op, family="linear",
                        provider="nvidia-cudnn-frontend",
                        bind=_ours_bind("cudnn", op, prenormed=True),
                        why_not=_ours_why_not("cudnn", op, prenormed=True)))
    return out


# ---------------------------------------------------------------------------------------------
# PyTorch peers: SDPA backends (cuDNN, FlashAttention-2, memory-efficient), varlen_attn
# ---------------------------------------------------------------------------------------------

_SDPA = {"cuDNN (SDPA)": "CUDNN_ATTENTION", "FA2 (SDPA flash)": "FLASH_ATTENTION",
         "mem-efficient (SDPA)": "EFFICIENT_ATTENTION"}


def _sdpa_context(kind: str):
    def ctx():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(getattr(SDPBackend, kind))
    return ctx


def _sdpa_why_not(label: str):
    def why(case, device, dtype, grad):
        if device.type != "cuda":
            return "needs a CUDA GPU (torch SDPA fused backends)"
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError:
            return f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel"
        if label.startswith("cuDNN") and not torch.backends.cudnn.is_available():
            return "torch was built without cuDNN"
        if label.startswith("FA2") and dtype not in (torch.float16, torch.bfloat16):
            return "FlashAttention-2 supports float16/bfloat16 only"
        return None
    return why


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()


def _sdpa_bind(label: str, decode: bool):
    def bind(case, t):
        q, k, v = (_leaf(_bhsd(t[n]), not decode) for n in ("q", "k", "v"))
        causal = case.get("causal", True) and not decode   # Sq = 1 sees the whole cache
        gqa = q.shape[1] != k.shape[1]
        kw = dict(is_causal=causal, enable_gqa=True) if gqa else dict(is_causal=causal)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, **kw)

        def spec(leaves, upcast):
            a, b, c = (x.transpose(1, 2) for x in leaves)
            return reference.attention(a, b, c, causal=case.get("causal", True), upcast=upcast)[0].transpose(1, 2)
        return Bound(fn=fn, leaves=[q, k, v], spec=spec, context=_sdpa_context(_SDPA[label]), inputs=[q, k, v])
    return bind


def _sdpa_varlen_bind(label: str, padded: bool):
    """cuDNN through SDPA on a packed batch: one call per sequence, or every sequence padded."""
    def bind(case, t):
        lens = case["seqlens"]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        if padded:
            mx = max(lens)
            pads = []
            for name in ("q", "k", "v"):
                x = t[name].new_zeros(len(lens), mx, *t[name].shape[1:])
                for i, n in enumerate(lens):
                    x[i, :n] = t[name][cu[i]:cu[i + 1]]
                pads.append(_leaf(_bhsd(x)))
            q, k, v = pads
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def post(o):   # (N, H, mx, D) -> packed (total, H, D)
                return torch.cat([o[i, :, :n].transpose(0, 1) for i, n in enumerate(lens)], 0)

            def spec(leaves, upcast):
                a, b, c = leaves
                outs = [reference.attention(a[i:i + 1, :, :n].transpose(1, 2), b[i:i + 1, :, :n].transpose(1, 2),
                                            c[i:i + 1, :, :n].transpose(1, 2), causal=True, upcast=upcast)[0][0]
                        for i, n in enumerate(lens)]
                return torch.cat(outs, 0)
            return Bound(fn=fn, leaves=[q, k, v], spec=spec, post=post,
                         context=_sdpa_context(_SDPA["cuDNN (SDPA)"]), inputs=[q, k, v])
        q, k, v = (_leaf(t[n].transpose(0, 1).contiguous()) for n in ("q", "k", "v"))   # (H, total, D)

        def fn():
            outs = [F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, a:b], v[None, :, a:b], is_causal=True)[0]
                    for a, b in zip(cu[:-1], cu[1:])]
            return torch.cat(outs, 1)          # (H, total, D)

        def spec(leaves, upcast):
            a, b, c = (x.transpose(0, 1) for x in leaves)
            cut = torch.tensor(cu, dtype=torch.int32, device=a.device)
            return reference.attention_varlen(a, b, c, cut, cut, causal=True, upcast=upcast)[0].transpose(0, 1)
        return Bound(fn=fn, leaves=[q, k, v], spec=spec, context=_sdpa_context(_SDPA["cuDNN (SDPA)"]),
                     inputs=[q, k, v])
    return bind


def _varlen_attn_why_not(case, device, dtype, grad):
    if device.type != "cuda":
        return "needs a CUDA GPU"
    try:
        importlib.import_module("torch.nn.attention.varlen").varlen_attn  # noqa: B018
    except (ImportError, AttributeError):
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (PyTorch >= 2.10)"
    if dtype not in (torch.float16, torch.bfloat16):
        return "varlen_attn supports float16/bfloat16 only"
    return None


def _varlen_attn_bind(case, t):
    from . import cases
    varlen_attn = importlib.import_module("torch.nn.attention.varlen").varlen_attn
    q, k, v = (_leaf(t[n]) for n in ("q", "k", "v"))
    cu, mx = t["cu_seqlens"], case["max_seqlen"]
    fn = lambda: varlen_attn(q, k, v, cu, cu, mx, mx, window_size=(-1, 0))
    return Bound(fn=fn, leaves=[q, k, v], spec=cases.spec("flash_varlen", case, t), inputs=[q, k, v])


def _cpu_sdpa_bind(case, t):
    q, k, v = (_leaf(_bhsd(t[n])) for n in ("q", "k", "v"))
    kw = dict(is_causal=case.get("causal", True))
    if q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True
    fn = lambda: F.scaled_dot_product_attention(q, k, v, **kw)

    def spec(leaves, upcast):
        a, b, c = (x.transpose(1, 2) for x in leaves)
        return reference.attention(a, b, c, causal=case.get("causal", True), upcast=upcast)[0].transpose(1, 2)
    return Bound(fn=fn, leaves=[q, k, v], spec=spec, inputs=[q, k, v])


def _append_last(t) -> None:
    """Write the step's new key / value at position ctx - 1 (what ``flash_attn_with_kvcache`` does in its
    call): the peers' step includes the same cache append."""
    kc, vc, k, v = t["k_cache"], t["v_cache"], t["k"][:, 0], t["v"][:, 0]
    n = t["cache_seqlens"]
    if "block_table" in t:
        page = kc.shape[1]
        pos = n.long()
        blocks = t["block_table"].long().gather(1, (pos // page)[:, None])[:, 0]
        kc[blocks, pos % page] = k
        vc[blocks, pos % page] = v
    else:
        last = kc.shape[1] - 1
        kc[:, last] = k
        vc[:, last] = v


def _kvcache_spec(case, t):
    """The reference of a peer's step: attention of q over the ``ctx`` cached keys after the append."""
    ctx = case["ctx"]

    def spec(leaves, upcast):
        q, kc, vc = leaves
        if "block_table" in t:
            table = t["block_table"].long()
            kc, vc = (c[table].flatten(1, 2) for c in (kc, vc))      # (B, pages * page, Hk, D) in sequence order
        return reference.attention(q, kc[:, :ctx], vc[:, :ctx], upcast=upcast)[0]
    return spec


def _sdpa_kvcache_why_not(label: str):
    base = _sdpa_why_not(label)

    def why(case, device, dtype, grad):
        if case.get("page"):
            return "SDPA reads contiguous caches only (no block table)"
        return base(case, device, dtype, grad)
    return why


def _sdpa_kvcache_bind(label: str):
    """SDPA on the same cache: flash-attn's decode path inside PyTorch. The cache (B, ctx, Hk, D) is read as
    (B, Hk, ctx, D) without a copy, and the Hq / Hk query heads of a group become that many query rows of
    their key head (one new token sees every cached key: no mask), which every SDPA backend runs without
    enable_gqa. The step appends the new key / value first, as ``flash_attn_with_kvcache`` does."""
    def bind(case, t):
        q, kc, vc = t["q"], t["k_cache"], t["v_cache"]
        b, _, hq, d = q.shape
        hk = kc.shape[2]
        qg, kt, vt = q.view(b, hk, hq // hk, d), kc.transpose(1, 2), vc.transpose(1, 2)

        def fn():
            _append_last(t)
            return F.scaled_dot_product_attention(qg, kt, vt).view(b, 1, hq, d)
        return Bound(fn=fn, leaves=[q, kc, vc], spec=_kvcache_spec(case, t), context=_sdpa_context(_SDPA[label]),
                     inputs=[q, kc, vc, t["k"], t["v"]])
    return bind


def _cudnn_paged_why_not(case, device, dtype, grad):
    if not case.get("page"):
        return "runs on paged caches only (the contiguous rows have SDPA's cuDNN kernel)"
    if device.type != "cuda":
        return "needs a CUDA GPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return "cuDNN paged attention supports float16/bfloat16 only"
    from ..ops.flash import cudnn as cudnn_ops
    err = cudnn_ops.frontend_error()
    if err:
        return err
    if cudnn_ops._cudnn().backend_version() < 90500:
        return "cuDNN paged attention needs cuDNN >= 9.5"
    return None


def _cudnn_paged_bind(case, t):
    """cudnn-frontend's SDPA over the paged cache (``paged_attention_k_table`` / ``_v_table``, the API of the
    frontend's sample 52): q (B, Hq, 1, D), the containers (blocks, Hk, page, D) as strided views of ours,
    the block table as (B, 1, pages, 1), every sequence ``ctx`` keys long (padding mask). Built once per row."""
    from ..ops.flash import cudnn as cudnn_ops
    cudnn = cudnn_ops._cudnn()
    q, kc, vc, table = t["q"], t["k_cache"], t["v_cache"], t["block_table"]
    b, _, hq, d = q.shape
    pages = table.shape[1]
    io = cudnn.data_type.HALF if q.dtype == torch.float16 else cudnn.data_type.BFLOAT16
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=cudnn_ops._handle(q.device))
    q4, kc4, vc4 = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    table4 = table.view(b, 1, pages, 1)
    ones = torch.ones(b, 1, 1, 1, dtype=torch.int32, device=q.device)
    lens = torch.full((b, 1, 1, 1), case["ctx"], dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    tq, tk, tv, tbk, tbv, tsq, tsk = (g.tensor_like(x) for x in (q4, kc4, vc4, table4, table4, ones, lens))
    o, _ = g.sdpa(name="sdpa", q=tq, k=tk, v=tv, generate_stats=False, attn_scale=d ** -0.5, use_padding_mask=True,
                  seq_len_q=tsq, seq_len_kv=tsk, paged_attention_k_table=tbk, paged_attention_v_table=tbv,
                  paged_attention_max_seq_len_kv=pages * kc.shape[1])
    o.set_output(True).set_dim(list(q4.shape)).set_stride(list(q4.stride()))
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    pack = {tq: q4, tk: kc4, tv: vc4, tbk: table4, tbv: table4, tsq: ones, tsk: lens, o: out.transpose(1, 2)}

    def fn():
        _append_last(t)
        g.execute(pack, cudnn_ops._workspace(q.device, g.get_workspace_size()), handle=cudnn_ops._handle(q.device))
        return out
    return Bound(fn=fn, leaves=[q, kc, vc], spec=_kvcache_spec(case, t), inputs=[q, kc, vc, t["k"], t["v"]])


# ---------------------------------------------------------------------------------------------
# flash-linear-attention (fla-core) peers
# ---------------------------------------------------------------------------------------------

def _fla_why_not(extra: Optional[Callable[[Dict], Optional[str]]] = None):
    def why(case, device, dtype, grad):
        if not package_available("fla"):
            return FLA_HINT
        if device.type != "cuda":
            return "needs a CUDA GPU (fla-core Triton kernels)"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"unsupported dtype {dtype}"
        return extra(case) if extra is not None else None
    return why


def _fla(module: str, attr: str):
    return getattr(importlib.import_module(module), attr)


def _fla_attn_bind(case, t):
    from . import cases
    parallel_attn = _fla("fla.ops.attn", "parallel_attn")
    q, k, v = (_leaf(t[n]) for n in ("q", "k", "v"))
    return Bound(fn=lambda: parallel_attn(q, k, v), leaves=[q, k, v], spec=cases.spec("flash", case, t),
                 inputs=[q, k, v])


def _fla_kda_bind(case, t):
    from . import cases
    chunk_kda = _fla("fla.ops.kda", "chunk_kda")
    names = cases.GRAD_INPUTS["kda"]
    q, k, v, g, beta = (_leaf(t[n]) for n in names)
    fn = lambda: chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    return Bound(fn=fn, leaves=[q, k, v, g, beta], spec=cases.spec("kda", case, t), inputs=[q, k, v, g, beta])


def _hgrn_spec(shape):
    b, tt, h, d = shape

    def spec(leaves, upcast):
        x, g = leaves
        x4, g4 = x.view(b, tt, 1, h * d), g.view(b, tt, 1, h * d)
        one = torch.ones_like(x4)
        o = reference.gated_diag(one, x4, one, g4, upcast=upcast)[0]
        return o.view(b, tt, h * d)
    return spec


def _fla_hgrn_bind(kind: str):
    def bind(case, t):
        fn_ = _fla("fla.ops.hgrn", kind)
        b, tt, h, d = t["q"].shape
        # HGRN's recurrence h_t = exp(g_t) h_{t-1} + x_t is the diagonal one with q = v = 1, k = x
        x = _leaf((t["k"] * t["v"]).reshape(b, tt, h * d))
        g = _leaf(t["g"].reshape(b, tt, h * d))
        return Bound(fn=lambda: fn_(x, g)[0], leaves=[x, g], spec=_hgrn_spec((b, tt, h, d)), inputs=[x, g])
    return bind


def _fla_kda_decode_bind(case, t):
    from . import cases
    fused_recurrent_kda = _fla("fla.ops.kda", "fused_recurrent_kda")
    q, k, v, g, beta, state = (t[n] for n in ("q", "k", "v", "g", "beta", "state"))
    fn = lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)[0]
    return Bound(fn=fn, leaves=[q, k, v, g, beta], spec=cases.spec("kda_decode", case, t),
                 inputs=[q, k, v, g, beta, state])


def _fla_diag_decode_bind(case, t):
    fused_recurrent_hgrn = _fla("fla.ops.hgrn", "fused_recurrent_hgrn")
    b, tt, h, d = t["q"].shape
    x = (t["k"] * t["v"]).reshape(b, tt, h * d)
    g = t["g"].reshape(b, tt, h * d).contiguous()
    s0 = t["state"].reshape(b, h * d)
    fn = lambda: fused_recurrent_hgrn(x, g, initial_state=s0, output_final_state=True)[0]
    s_init = s0.clone()

    def spec(leaves, upcast):
        xx, gg = leaves
        one = torch.ones_like(xx.view(b, tt, 1, h * d))
        st = s_init.view(b, 1, h * d).to(reference.accumulation_dtype(xx.dtype))
        return reference.gated_diag(one, xx.view(b, tt, 1, h * d), one, gg.view(b, tt, 1, h * d),
                                    initial_state=st, upcast=upcast)[0].view(b, tt, h * d)
    return Bound(fn=fn, leaves=[x, g], spec=spec, inputs=[x, g, s0])


def _causal_only(case):
    if not case.get("causal", True):
        return "parallel_attn is causal only"
    return None


# ---------------------------------------------------------------------------------------------
# the catalogue
# ---------------------------------------------------------------------------------------------

CUDNN_KDA_NATIVE = "cuDNN-FE kimi_delta_attention (native)"


def _cudnn_kda_native_why_not(case, device, dtype, grad):
    from ..ops.kda import cudnn as kc
    if device.type != "cuda":
        return "needs a CUDA GPU"
    why = kc.frontend_error() or kc.toolchain_error()
    if why:
        return why
    if torch.cuda.get_device_capability(device) != kc.SM90:
        return "the frontend's KDA engine declared here is the sm_90 one (Hopper)"
    if dtype not in kc.DTYPES:
        return f"cuDNN KDA takes bf16 q/k/v, got {dtype}"
    return kc.head_dims((case["D"], case["D"]))


def _cudnn_kda_native_bind(case, t):
    """cuDNN frontend's ``kimi_delta_attention`` as its users call it, every input in its own form made once outside
    the timed call: q, k, v as THD views, g and beta in float32, ``cu_seqlens`` on the device. q and k are
    L2-normalised here once, as its backward needs (it has no in-kernel norm); the forward (no autograd) still
    asks for the in-kernel norm, a no-op on unit rows up to rounding, so its forward does the work ours does."""
    from ..ops.kda import cudnn as kc
    kc.frontend_error()
    fe = kc._FE["kda"]
    b, s, h, d = t["q"].shape
    q, k = (_leaf(kc.prenorm(t[n]).reshape(b * s, h, d)) for n in ("q", "k"))
    v = _leaf(t["v"].reshape(b * s, h, d))
    g = _leaf(t["g"].float().reshape(b * s, h, d))
    beta = _leaf(t["beta"].float().reshape(b * s, h))
    cu = torch.arange(b + 1, device=q.device, dtype=torch.int32) * s

    def fn():
        out = fe(q, k, v, g, beta, cu, use_qk_l2norm_in_kernel=not torch.is_grad_enabled())
        return out[0] if isinstance(out, (tuple, list)) else out

    def spec(L, upcast):
        L = [x.reshape(b, s, h, -1) if x.dim() == 3 else x.reshape(b, s, h) for x in L]
        return reference.kda(*L, use_qk_l2norm=False, upcast=upcast)[0].reshape(b * s, h, d)

    return Bound(fn=fn, leaves=[q, k, v, g, beta], spec=spec, inputs=[q, k, v, g, beta])


def peers(op: str, device: torch.device) -> List[Impl]:
    p: List[Impl] = []
    if op in ("flash", "flash_decode"):
        for label in _SDPA:
            p.append(Impl(label, op, "quadratic", "torch", _sdpa_bind(label, op == "flash_decode"),
                          _sdpa_why_not(label), backward=op == "flash"))
        if device.type == "cpu" and op == "flash":
            p.append(Impl("torch SDPA (CPU)", op, "quadratic", "torch", _cpu_sdpa_bind,
                          lambda c, d, t, g: None if d.type == "cpu" else "CPU peer"))
        if op == "flash":
            p.append(Impl("FLA parallel_attn", op, "quadratic", "fla-core", _fla_attn_bind,
                          _fla_why_not(_causal_only)))
    elif op == "kvcache_decode":
        for label in _SDPA:
            p.append(Impl(label, op, "quadratic", "torch", _sdpa_kvcache_bind(label), _sdpa_kvcache_why_not(label),
                          backward=False))
        p.append(Impl("cuDNN paged (cudnn-frontend)", op, "quadratic", "nvidia-cudnn-frontend", _cudnn_paged_bind,
                      _cudnn_paged_why_not, backward=False))
    elif op == "flash_varlen":
        p.append(Impl("torch varlen_attn", op, "quadratic", "torch", _varlen_attn_bind, _varlen_attn_why_not))
        p.append(Impl("cuDNN (SDPA), one call per sequence", op, "quadratic", "torch",
                      _sdpa_varlen_bind("cuDNN", False), _sdpa_why_not("cuDNN (SDPA)")))
        p.append(Impl("cuDNN (SDPA), padded to the longest", op, "quadratic", "torch",
                      _sdpa_varlen_bind("cuDNN", True), _sdpa_why_not("cuDNN (SDPA)")))
    elif op == "kda":
        p.append(Impl("FLA chunk_kda", op, "linear", "fla-core", _fla_kda_bind, _fla_why_not()))
        p.append(Impl(CUDNN_KDA_NATIVE, op, "linear", "nvidia-cudnn-frontend", _cudnn_kda_native_bind,
                      _cudnn_kda_native_why_not))
    elif op == "diag":
        p.append(Impl("FLA chunk_hgrn", op, "linear", "fla-core", _fla_hgrn_bind("chunk_hgrn"), _fla_why_not()))
        p.append(Impl("FLA fused_recurrent_hgrn", op, "linear", "fla-core", _fla_hgrn_bind("fused_recurrent_hgrn"),
                      _fla_why_not()))
    elif op == "kda_decode":
        p.append(Impl("FLA fused_recurrent_kda", op, "linear", "fla-core", _fla_kda_decode_bind, _fla_why_not(),
                      backward=False))
    elif op == "diag_decode":
        p.append(Impl("FLA fused_recurrent_hgrn", op, "linear", "fla-core", _fla_diag_decode_bind, _fla_why_not(),
                      backward=False))
    return p


def catalogue(op: str, device: torch.device) -> List[Impl]:
    """delta-attn's backends first, then the peers."""
    return ours(op, device) + peers(op, device)
