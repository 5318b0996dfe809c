"""Public gated diagonal attention entry points (``gated_diag_attn``, ``gated_diag_step``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ... import _checks as C
from ... import _install
from ...backends import Call, Capability, explain_call, recurrent_features, register, select


@dataclass(frozen=True)
class DiagArgs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    initial_state: Optional[torch.Tensor]
    output_final_state: bool
    cu_seqlens: Optional[torch.Tensor]
    num_seqs: int
    state: Optional[torch.Tensor] = None            # gated_diag_step: the state pool, updated in place
    state_indices: Optional[torch.Tensor] = None    # slot of each sequence (B,) or token (B, T)
    num_accepted_tokens: Optional[torch.Tensor] = None   # with (B, T) slots: start slot column + 1

    def call(self, op: str) -> Call:
        feats = recurrent_features(self.cu_seqlens, self.initial_state, self.output_final_state, self.state_indices)
        return Call(op=op, device=self.q.device, dtype=self.q.dtype, head_dims=(self.q.shape[-1],),
                    features=frozenset(feats), needs_grad=self.needs_grad())

    def needs_grad(self) -> bool:
        """Grad mode on and a differentiable input (q, k, v, g, initial_state) requires grad."""
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (self.q, self.k, self.v, self.g, self.initial_state))


def _validate_qkvg(q, k, v, g):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        C.tensor(name, t, 4, shape_doc="(B, T, H, D)")
    C.same_dtype(q=q, k=k, v=v)
    if g.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"g must have the dtype of q ({q.dtype}) or float32, got {g.dtype}")
    C.same_device(q=q, k=k, v=v, g=g)
    for name, t in (("k", k), ("v", v), ("g", g)):
        C.shape_equal(name, t, tuple(q.shape), "(the shape of q: B, T, H, D)")
    C.positive_dim("heads", q.shape[2])
    C.positive_dim("head dim D", q.shape[3])


def validate(q, k, v, g, initial_state=None, output_final_state=False, cu_seqlens=None) -> DiagArgs:
    _validate_qkvg(q, k, v, g)
    C.flag("output_final_state", output_final_state)
    b, t, h, d = q.shape
    n = b
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {b}")
        cu_seqlens, n = C.cu_seqlens("cu_seqlens", cu_seqlens, t, q.device)   # int32, contiguous
    C.log_decay("g", g)
    C.state("initial_state", initial_state, (n, h, d), q.device, "(N, H, D) float32")
    return DiagArgs(q, k, v, g, initial_state, output_final_state, cu_seqlens, n)


def _check_step(q, k, v, g, state, state_indices, num_accepted_tokens) -> None:
    """The checks of a decode step that read no device value."""
    _validate_qkvg(q, k, v, g)
    b, t, h, d = q.shape
    C.positive_dim("new tokens per sequence (q.shape[1])", t)
    C.tensor("state", state, 3, (torch.float32, torch.float64), "(P, H, D) float32 state pool")
    C.shape_equal("state", state, (state.shape[0], h, d), "(P, H, D)")
    if state.device != q.device:
        raise ValueError(f"state must be on the device of the inputs ({q.device}), got {state.device}")
    C.state_indices(state_indices, b, state.shape[0], q.device, t, num_accepted_tokens, values=False)


def validate_step(q, k, v, g, state, state_indices=None, num_accepted_tokens=None) -> DiagArgs:
    # shapes, dtypes, devices: once per signature (C.memoized); slot values: every call
    C.memoized("diag_step", _check_step, q, k, v, g, state, state_indices, num_accepted_tokens)
    C.state_indices_value_checks(state_indices, state.shape[0], num_accepted_tokens)
    C.log_decay("g", g)
    b = q.shape[0]
    return DiagArgs(q, k, v, g, None, False, None, b, state=state, state_indices=state_indices,
                    num_accepted_tokens=num_accepted_tokens)


def gated_diag_attn(q, k, v, g, *, initial_state=None, output_final_state=False, cu_seqlens=None,
                    backend="auto"):
    """Gated diagonal linear attention: ``s_t = exp(g_t) * s_{t-1} + k_t * v_t``, ``o_t = q_t * s_t``.

    q, k, v, g (B, T, H, D); ``initial_state`` (N, H, D) float32; with ``cu_seqlens`` B == 1.
    Returns ``(o (B, T, H, D), final_state (N, H, D) float32 or None)``.

    g is a log decay and must be <= 0 (``-inf`` resets the state): a positive entry is a ``ValueError``
    naming g, checked on the host wherever value checks run (not under CUDA-graph capture, torch.compile
    tracing or ``DELTA_ATTN_SKIP_VALUE_CHECKS=1``, where the caller keeps g <= 0).

    Non-finite inputs: the recurrence is evaluated as written, sequence by sequence (every backend).
    A NaN in ``g`` at token p of a sequence makes that sequence's state NaN from p on, so its outputs
    from p on and its final state are NaN (a full decay after it keeps it NaN: ``exp(-1e4) * NaN``; at a
    first token with no initial state, ``exp(NaN) * 0`` is NaN too); no decay is clamped, so a NaN gate
    never turns into a silent reset. Every other sequence of the batch (varlen or dense) is computed
    exactly as without it, and so are its gradients; the NaN sequence's gradients are NaN where
    autograd through ``delta_attn.reference.gated_diag`` gives NaN.

    >>> import torch, delta_attn as da
    >>> q, k, v = torch.randn(3, 2, 9, 4, 8).unbind(0)
    >>> o, s = da.gated_diag_attn(q, k, v, -torch.rand(2, 9, 4, 8), output_final_state=True, backend="torch")
    >>> o.shape, s.shape
    (torch.Size([2, 9, 4, 8]), torch.Size([2, 4, 8]))
    """
    args = validate(q, k, v, g, initial_state, output_final_state, cu_seqlens)
    return select(args.call("diag"), backend)(args)


def gated_diag_step(q, k, v, g, state, *, state_indices=None, num_accepted_tokens=None, backend="auto"):
    """Decode: the diagonal recurrence over T new tokens from a state pool (P, H, D), updated in place.

    q, k, v, g (B, T, H, D); returns o (B, T, H, D). Inference only. Slots as in :func:`kda_step`:
    ``state_indices`` None (``state[b]``), (B,) (one slot per sequence, read and written), or (B, T) for
    speculative decoding (the state after token t goes to ``state[state_indices[b, t]]``; the step starts
    from ``state_indices[b, num_accepted_tokens[b] - 1]``, from column 0 when ``num_accepted_tokens`` is
    None). Capturable in a CUDA graph; under capture the host-side value checks of the slots and of g (a log
    decay <= 0, as in :func:`gated_diag_attn`) are skipped.
    A NaN gate makes its own slot NaN, as in :func:`gated_diag_attn`; other sequences' slots and outputs are
    unaffected.

    >>> import torch, delta_attn as da
    >>> q, k, v = torch.randn(3, 2, 4, 2, 8).unbind(0)       # 2 sequences, 4 tokens (1 + 3 drafts)
    >>> pool, slots = torch.zeros(10, 2, 8), torch.arange(8).view(2, 4)
    >>> o = da.gated_diag_step(q, k, v, -torch.rand(2, 4, 2, 8), pool, state_indices=slots, backend="torch")
    >>> o = da.gated_diag_step(q, k, v, -torch.rand(2, 4, 2, 8), pool, state_indices=slots,
    ...                        num_accepted_tokens=torch.tensor([1, 4]), backend="torch")
    >>> o.shape
    torch.Size([2, 4, 2, 8])
    """
    args = validate_step(q, k, v, g, state, state_indices, num_accepted_tokens)
    return select(args.call("diag_step"), backend)(args)


gated_diag_attn.plan = lambda *a, backend="auto", **kw: explain_call(validate(*a, **kw).call("diag"), backend)
gated_diag_step.plan = lambda *a, backend="auto", **kw: explain_call(
    validate_step(*a, **kw).call("diag_step"), backend)

_FEATURES = frozenset({"varlen", "initial_state", "final_state", "state_indices", "speculative"})
_ANY = dict(device_types=("cpu", "cuda", "mps", "xpu"), dtypes=C.FLOAT_DTYPES, features=_FEATURES)
register("torch", "diag", Capability(impl="delta_attn.ops.diag.torch_impl:gated_diag", **_ANY))
register("torch", "diag_step", Capability(impl="delta_attn.ops.diag.torch_impl:gated_diag_step", backward=False,
                                          **_ANY))

_TRITON = dict(device_types=("cuda", "cpu"), dtypes=(torch.float16, torch.bfloat16, torch.float32),
               features=_FEATURES, requires=("triton",), install_hint=_install.TRITON)
register("triton", "diag", Capability(impl="delta_attn.ops.diag.triton_impl:gated_diag", **_TRITON))
register("triton", "diag_step", Capability(impl="delta_attn.ops.diag.triton_impl:gated_diag_step", backward=False,
                                           **_TRITON))
