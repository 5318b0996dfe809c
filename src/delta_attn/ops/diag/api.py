"""Gated diagonal attention's public functions (``gated_diag_attn``, ``gated_diag_step``) and their validation.

Each validates every argument before anything runs, builds a :class:`~delta_attn.ops.diag.args.DiagArgs` and hands
it to the backend the registry selects (``register.py`` declares what each backend supports).
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import _checks as C
from ...backends import explain_call, select
from .args import DiagArgs


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


def validate(q, k, v, g, initial_state=None, output_final_state=False, cu_seqlens=None,
             pending: Optional[C.PendingChecks] = None) -> DiagArgs:
    """The validated call; ``pending``: the check of g's range deferred into it (``C.log_decay``)."""
    _validate_qkvg(q, k, v, g)
    C.flag("output_final_state", output_final_state)
    b, t, h, d = q.shape
    n = b
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {b}")
        cu_seqlens, n = C.cu_seqlens("cu_seqlens", cu_seqlens, t, q.device)   # int32, contiguous
    C.log_decay("g", g, pending=pending)
    C.state("initial_state", initial_state, (n, h, d), q.device, "(N, H, D) float32")
    return DiagArgs(q, k, v, g, initial_state, output_final_state, cu_seqlens, n)


def _check_step(q, k, v, g, state, state_indices, num_accepted_tokens) -> None:
    """The checks of a decode step that read no device value."""
    _validate_qkvg(q, k, v, g)
    C.decode_step(q, state, q.shape[2:], "(P, H, D)", state_indices, num_accepted_tokens)


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
    pending = C.PendingChecks()      # g's range: reduced before the kernels, read after (outputs are new)
    args = validate(q, k, v, g, initial_state, output_final_state, cu_seqlens, pending)
    return pending.run(lambda: select(args.call("diag"), backend), args)


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
