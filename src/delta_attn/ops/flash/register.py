"""What each backend supports for the attention operators (``flash``, ``flash_varlen``, ``flash_kvcache``):
the capability declarations of the registry (``delta_attn/backends.py``), in one place.

:func:`register_backends` runs once, when the package is imported (``ops/flash/__init__.py``). Registering
imports no kernel and no optional package: implementations are ``"module:function"`` strings imported on first
use, and the probes read here (``cudnn.frontend_error``, ``sdpa.flash_op_available``, ...) import the cudnn
frontend only when a CUDA call asks. The ``auto`` order among these backends is the registry's
(``backends.attention_policy``, measurements in docs/DISPATCH.md).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ... import _checks as C
from ... import _install
from ... import backends as B
from ...backends import Call, Capability, register
from . import cudnn, sdpa

_PKG = "delta_attn.ops.flash"
# every feature of an attention call (args.AttnArgs.call)
ALL_FEATURES = frozenset({"causal", "window", "softcap", "alibi", "dropout", "gqa", "deterministic",
                          "head_dim_v", "varlen", "layout_htd", "sq_ne_sk", "single_token"})
# every feature of a KV-cache call (args.KVCacheArgs.call)
KVCACHE_FEATURES = frozenset({"causal", "window", "softcap", "alibi", "gqa", "paged", "new_kv", "rotary",
                              "cache_batch_idx", "leftpad"})
_FP16 = (torch.float16, torch.bfloat16)

# ---------------------------------------------------------------------------------------------
# torch: the reference, any device and dtype, every feature
# ---------------------------------------------------------------------------------------------

_TORCH = dict(device_types=("cpu", "cuda", "mps", "xpu"), dtypes=C.FLOAT_DTYPES)

# ---------------------------------------------------------------------------------------------
# triton: delta-attn's kernels (kernels_*.py through launch.py and autograd.py)
# ---------------------------------------------------------------------------------------------


def triton_head_dims(dims) -> Optional[str]:
    d, dv = dims[0], dims[-1]
    if d != dv:
        return f"needs the same head dim for q/k and v, got {d} and {dv}"
    if d % 8 or not 8 <= d <= 256:
        return f"supports head dims that are multiples of 8 from 8 to 256, got {d}"
    return None


_TRITON = dict(head_dims=triton_head_dims, requires=("triton",), install_hint=_install.TRITON)

# ---------------------------------------------------------------------------------------------
# cudnn: SDPA's cuDNN kernel and cudnn-frontend graphs (cudnn.py)
# ---------------------------------------------------------------------------------------------

CUDNN_FRONTEND_HINT = _install.CUDNN
CUDNN_MAX_HEAD_DIM = 128     # declared (and tested) for cuDNN 9.x on sm90; larger dims are not claimed


def _cudnn_head_dims(dims: Tuple[int, ...]) -> Optional[str]:
    bad = [d for d in dims if d % 8 != 0 or d > CUDNN_MAX_HEAD_DIM]
    if bad:
        return (f"head dims must be multiples of 8 and at most {CUDNN_MAX_HEAD_DIM} for cuDNN fused attention, "
                f"got {'x'.join(map(str, dims))}")
    return None


def _cudnn_library_reasons(min_version: int) -> List[str]:
    ver = cudnn.torch_cudnn_version()
    if ver is None:
        return ["PyTorch has no cuDNN library here"]
    if ver < min_version:
        return [f"needs cuDNN >= {min_version // 10000}.{min_version // 100 % 100}, PyTorch loads {ver}"]
    return []


def _check_cudnn_dense(call: Call) -> List[str]:
    if call.device.type != "cuda":
        return []
    reasons = _cudnn_library_reasons(90000)
    if cudnn.dense_needs_graph(call.features):
        what = sorted(call.features & cudnn.NEEDS_GRAPH) or ["causal with Sq != Sk"]
        if call.compiling:
            reasons.append(f"{', '.join(what)} on dense calls run cudnn-frontend graphs from Python, which "
                           f"torch.compile cannot trace")
        if not B.package_available("cudnn"):
            reasons.append(f"{', '.join(what)} on dense calls need cudnn-frontend graphs: nvidia-cudnn-frontend not "
                           f"installed — {CUDNN_FRONTEND_HINT}")
        elif cudnn.frontend_error():
            reasons.append(cudnn.frontend_error())
        cc = B.device_capability(call.device)
        if cc is not None and cc < (9, 0):
            reasons.append(f"{', '.join(what)} on dense calls use ragged cuDNN graphs, which need compute "
                           f"capability >= 9.0, device has {cc[0]}.{cc[1]}")
    return reasons


def _check_cudnn_varlen(call: Call) -> List[str]:
    if call.device.type != "cuda":
        return []
    reasons = _cudnn_library_reasons(90600)
    if B.package_available("cudnn") and cudnn.frontend_error():
        reasons.append(cudnn.frontend_error())
    return reasons


# ---------------------------------------------------------------------------------------------
# sdpa: PyTorch's own kernels (sdpa.py)
# ---------------------------------------------------------------------------------------------


def _sdpa_cpu_reasons(call: Call) -> List[str]:
    if not sdpa.cpu_op_available():
        return [f"this PyTorch ({torch.__version__}) lacks aten::_scaled_dot_product_flash_attention_for_cpu "
                f"with attn_mask"]
    return []


def _sdpa_head_dims(dims: Tuple[int, ...]) -> Optional[str]:
    d, dv = dims
    if d != dv:
        return f"needs equal q/k and v head dims, got {d} and {dv}"
    if d % 8 != 0 or d > 256:
        return f"head dim must be a multiple of 8 and at most 256 (FlashAttention-2), got {d}"
    return None


def _sdpa_cuda_reasons(call: Call) -> List[str]:
    reasons = []
    if not sdpa.flash_op_available():
        reasons.append(f"this PyTorch ({torch.__version__}) lacks aten::_flash_attention_forward with window bounds")
    if call.dtype == torch.float32:
        if call.op == "flash_varlen":
            reasons.append("float32 varlen has no PyTorch fused kernel (FlashAttention-2 is fp16/bf16 only)")
        else:
            bad = sorted(call.features & {"window", "gqa"})
            if bad:
                reasons.append(f"float32 runs on the memory-efficient kernel, which has no {', '.join(bad)}")
            if "causal" in call.features and "sq_ne_sk" in call.features:
                reasons.append("float32 runs on the memory-efficient kernel, whose causal mask is top-left "
                               "aligned: causal with Sq != Sk would differ from the bottom-right semantics")
    return reasons


_SDPA_DENSE = frozenset({"causal", "window", "gqa", "sq_ne_sk", "single_token"})
_SDPA_VARLEN = frozenset({"causal", "window", "gqa", "varlen", "layout_htd"})


def register_backends() -> None:
    """Declare every backend of ``flash``, ``flash_varlen`` and ``flash_kvcache``."""
    for op in ("flash", "flash_varlen"):
        register("torch", op, Capability(impl=f"{_PKG}.torch_impl:attention", features=ALL_FEATURES, **_TORCH))
        # fp16 / bf16, forward + backward; CPU tensors only under the interpreter (the registry's device rule)
        register("triton", op, Capability(impl=f"{_PKG}.autograd:attention", device_types=("cuda",), dtypes=_FP16,
                                          features=ALL_FEATURES - {"head_dim_v"}, **_TRITON))
    register("torch", "flash_kvcache", Capability(impl=f"{_PKG}.torch_impl:kvcache", features=KVCACHE_FEATURES,
                                                  backward=False, **_TORCH))
    register("triton", "flash_kvcache", Capability(
        impl=f"{_PKG}.autograd:kvcache", device_types=("cuda", "cpu"), dtypes=_FP16 + (torch.float32,),
        features=KVCACHE_FEATURES, backward=False, **_TRITON))

    register("cudnn", "flash", Capability(
        impl=f"{_PKG}.cudnn:attention", dtypes=_FP16, min_compute_capability=(8, 0),
        features=frozenset({"causal", "sq_ne_sk"}) | cudnn.NEEDS_GRAPH, head_dims=_cudnn_head_dims,
        check=_check_cudnn_dense, install_hint=CUDNN_FRONTEND_HINT))
    register("cudnn", "flash_varlen", Capability(
        impl=f"{_PKG}.cudnn:attention", dtypes=_FP16, min_compute_capability=(9, 0),
        features=frozenset({"causal", "window", "gqa", "deterministic", "head_dim_v", "varlen", "layout_htd"}),
        requires=("cudnn",), install_hint=CUDNN_FRONTEND_HINT, head_dims=_cudnn_head_dims, check=_check_cudnn_varlen,
        traceable=False))    # cudnn-frontend graphs are executed from Python

    # CUDA: FlashAttention-2 (fp16 / bf16) and the memory-efficient kernel (float32 dense)
    sdpa_impl = f"{_PKG}.sdpa:attention"
    register("sdpa", "flash", Capability(
        impl=sdpa_impl, dtypes=_FP16 + (torch.float32,), min_compute_capability=(8, 0), features=_SDPA_DENSE,
        head_dims=_sdpa_head_dims, check=_sdpa_cuda_reasons))
    register("sdpa", "flash_varlen", Capability(
        impl=sdpa_impl, dtypes=_FP16, min_compute_capability=(8, 0), features=_SDPA_VARLEN,
        head_dims=_sdpa_head_dims, check=_sdpa_cuda_reasons))
    # CPU tensors: PyTorch's CPU flash kernel, any head dim (q/k and v equal), GQA, every float dtype, an additive
    # mask built for causal / windows aligned bottom-right; the varlen path loops over the sequences on the host
    # (cu_seqlens read once), which torch.compile cannot trace
    cpu = dict(impl=sdpa_impl, device_types=("cpu",), dtypes=C.FLOAT_DTYPES, check=_sdpa_cpu_reasons)
    register("sdpa", "flash", Capability(features=_SDPA_DENSE, **cpu), device_type="cpu")
    register("sdpa", "flash_varlen", Capability(features=_SDPA_VARLEN, traceable=False, **cpu), device_type="cpu")
