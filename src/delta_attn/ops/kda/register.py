"""What each backend supports for Kimi Delta Attention (``kda``, ``kda_step``): the capability declarations of
the registry (``delta_attn/backends.py``) and ``auto``'s order for ``kda`` (:func:`auto_policy`), registered once
when the package is imported (``ops/kda/__init__.py``).
Implementations are ``"module:function"`` strings imported on first use; ``cudnn.py`` (what the cuDNN backend
declares and refuses) imports no cudnn package until a call runs."""
from __future__ import annotations

import torch

from ... import _checks as C
from ... import _install
from ... import backends as B
from ...backends import Call, Capability, register, set_auto_policy
from . import cudnn

_PKG = "delta_attn.ops.kda"
FEATURES = frozenset({"varlen", "initial_state", "final_state", "qk_l2norm", "gate_softplus",
                      "gate_lower_bound", "gva", "state_indices", "speculative", "strong_decay", "decay_unread"})
_TORCH = dict(device_types=("cpu", "cuda", "mps", "xpu"), dtypes=C.FLOAT_DTYPES, features=FEATURES)


def _triton_head_dims(dims):
    kd, vd = dims
    for name, d in (("K", kd), ("V", vd)):
        if d % 16 != 0 or d > 256:
            return f"head dim {name} = {d} unsupported: the triton KDA kernels need a multiple of 16 up to 256"
    return None


# CPU tensors under TRITON_INTERPRET=1 only (the registry's device rule)
_TRITON = dict(device_types=("cuda", "cpu"), dtypes=(torch.float16, torch.bfloat16, torch.float32),
               features=FEATURES, requires=("triton",), install_hint=_install.TRITON, head_dims=_triton_head_dims)


# auto: cuDNN's KDA first for training calls on dense batches of sequences up to this length (tokens per sequence),
# where Triton's training runs its Triton kernels; never where it runs its Gluon ones (sm_90, Triton 3.6)
CUDNN_TRAINING_MAX_SEQLEN = 32768
CUDNN_WHY = ("training on dense sequences of <= 32768 tokens where Triton's training runs its Triton kernels (not "
             "its sm_90 Gluon ones: Triton is not 3.6): cuDNN's KDA measured 1.45-2.2x faster forward+backward "
             "(H100, 65536 tokens per batch, sequences of 512-32768; docs/DISPATCH.md)")
TRITON_WHY = {
    "gluon": ("training where Triton's training runs its sm_90 Gluon kernels: through the two backends, each with "
              "its g check, they measured 1.06-1.19x faster forward+backward than cuDNN's KDA on batches of 1024-4096-"
              "token sequences with long-memory decays (H100; cuDNN's engine refuses strong decays, g < -5) and "
              "1.55-1.75x on sequences of 16384-131072 (H200); shorter sequences not measured (docs/DISPATCH.md)"),
    "grad": "training on sequences longer than 32768 tokens: Triton and cuDNN measured even (1.05x at 65536)",
    "varlen": "packed (varlen) batch: each new token total builds a cuDNN graph (about 40 ms), so Triton",
    "forward": ("forward only: Triton, whose fused Gluon kernel runs bf16, K = V = 128 calls without gate parameters "
                "on sm_90 from 64 (sequence, value head) pairs (1.1-2.3x the split kernels, H200), the split kernels "
                "otherwise (docs/DISPATCH.md); cuDNN's forward is faster with strong decays, but each new shape builds "
                "a cuDNN graph of about 40 ms, which prefill lengths that change per request would pay on every call "
                "(ask for backend='cudnn' with fixed shapes)"),
}


def _triton_trains_on_gluon(call: Call) -> bool:
    """Whether Triton's training of a call cuDNN can run takes its sm_90 Gluon kernels: cuDNN's own conditions
    (sm_90, bf16, K = V = 128, no gate) are theirs, so the installed Triton decides (``_gluon.kernels_release``)."""
    if not B.package_available("triton"):
        return False
    from .. import _gluon          # imports Triton: only once a CUDA training call asks
    return _gluon.kernels_release(call.device)


def prefers_cudnn(call: Call) -> bool:
    """Whether ``auto`` tries cuDNN first for a ``kda`` call: a training call on a dense batch of sequences of at
    most CUDNN_TRAINING_MAX_SEQLEN tokens, on the sm_90 GPU cuDNN's engine runs, that cuDNN declares it can run
    (decay range aside: ``api.py`` reads it only when this holds) and Triton's training would run on its Triton
    kernels (its Gluon ones measured faster)."""
    if call.op != "kda" or not call.needs_grad or call.device.type != "cuda" or not call.seqlen \
            or "varlen" in call.features:
        return False
    if call.seqlen > CUDNN_TRAINING_MAX_SEQLEN or B.device_capability(call.device) != cudnn.SM90:
        return False
    return not B.BACKENDS["cudnn"].not_supported_reasons(call) and not _triton_trains_on_gluon(call)


def auto_policy(call: Call):
    """``auto`` for ``kda``: cuDNN first where it measured faster (:func:`prefers_cudnn`), else Triton."""
    return ("cudnn", "triton", "torch") if prefers_cudnn(call) else ("triton", "torch")


def _auto_note(call: Call) -> str:
    if prefers_cudnn(call):
        return CUDNN_WHY
    if call.device.type != "cuda":
        return "not a CUDA call: Triton (the interpreter on CPU), then the reference"
    if not call.needs_grad:
        return TRITON_WHY["forward"]
    if not call.seqlen:
        return TRITON_WHY["varlen"]
    if call.seqlen > CUDNN_TRAINING_MAX_SEQLEN:
        return TRITON_WHY["grad"]
    if B.device_capability(call.device) == cudnn.SM90 and not B.BACKENDS["cudnn"].not_supported_reasons(call):
        return TRITON_WHY["gluon"]         # cuDNN could run it: not first only because of the Gluon kernels
    return "Triton first: cuDNN cannot run this call (its reasons are listed)"


auto_policy.describe = _auto_note


def register_backends() -> None:
    """Declare every backend of ``kda`` and ``kda_step``."""
    register("torch", "kda", Capability(impl=f"{_PKG}.torch_impl:kda", **_TORCH))
    register("torch", "kda_step", Capability(impl=f"{_PKG}.torch_impl:kda_step", backward=False, **_TORCH))
    register("triton", "kda", Capability(impl=f"{_PKG}.autograd:kda", **_TRITON))
    register("triton", "kda_step", Capability(impl=f"{_PKG}.autograd:kda_step", backward=False, **_TRITON))
    # backend="cudnn": cuDNN frontend's KDA op (sm_90 engine); what it declares and refuses is in cudnn.py
    register("cudnn", "kda", Capability(
        impl=f"{_PKG}.cudnn:kda", dtypes=cudnn.DTYPES, features=cudnn.FEATURES, min_compute_capability=cudnn.SM90,
        requires=("cudnn",), install_hint=cudnn.INSTALL_HINT, head_dims=cudnn.head_dims, check=cudnn.check))
    set_auto_policy("kda", auto_policy)
