"""``backend="triton"`` for gated diagonal attention: the ``torch.library`` custom ops over the launchers of
``launch.py``, the autograd Function and the backend entries (the wrapper pattern of every operator,
docs/ARCHITECTURE.md).

``delta_attn::diag_fwd``, ``delta_attn::diag_bwd`` and ``delta_attn::diag_step`` have fake implementations
(``torch.compile(fullgraph=True)`` traces through them); :class:`GatedDiagFunction` ties forward and backward
together; the backend entries (:func:`gated_diag`, :func:`gated_diag_step`) take the Function when a gradient is
needed, else the op's body in eager mode (the op while traced).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._launch import eager_or_op
from .args import DiagArgs
from .launch import _carry_words, _configs, _shape, diag_bwd, diag_fwd, diag_step

# ---------------------------------------------------------------------------------------------
# torch.library custom ops (fake implementations give shapes for torch.compile)
# ---------------------------------------------------------------------------------------------

def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
         output_final_state: bool, training: bool = False
         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return diag_fwd(q, k, v, g, initial_state, cu_seqlens, output_final_state, training=training)


_diag_fwd_op = torch.library.custom_op("delta_attn::diag_fwd", _fwd, mutates_args=())


@_diag_fwd_op.register_fake
def _(q, k, v, g, initial_state, cu_seqlens, output_final_state, training=False):
    total, _, n, h, d = _shape(q, cu_seqlens)
    words = _carry_words(_configs()[0], total, training)
    final = q.new_empty((n, h, d) if output_final_state else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), final, q.new_empty((words, h, d), dtype=torch.int64)


def _bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, do: torch.Tensor,
         ws: torch.Tensor, initial_state: Optional[torch.Tensor], dfinal: Optional[torch.Tensor],
         cu_seqlens: Optional[torch.Tensor]
         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return diag_bwd(q, k, v, g, do, ws, initial_state, dfinal, cu_seqlens)


_diag_bwd_op = torch.library.custom_op("delta_attn::diag_bwd", _bwd, mutates_args=())


@_diag_bwd_op.register_fake
def _(q, k, v, g, do, ws, initial_state, dfinal, cu_seqlens):
    # contiguous, as the real op's outputs (empty_like would copy the inputs' strides)
    dh0 = (initial_state.new_empty(initial_state.shape) if initial_state is not None
           else q.new_empty((0,), dtype=torch.float32))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape), dh0


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor,
          state_indices: Optional[torch.Tensor], num_accepted_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    return diag_step(q, k, v, g, state, state_indices, num_accepted_tokens)


_diag_step_op = torch.library.custom_op("delta_attn::diag_step", _step, mutates_args=("state",))


@_diag_step_op.register_fake
def _(q, k, v, g, state, state_indices, num_accepted_tokens=None):
    return q.new_empty(q.shape)


class GatedDiagFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, cu_seqlens, output_final_state):
        o, final, ws = eager_or_op(_fwd, _diag_fwd_op, q)(q, k, v, g, initial_state, cu_seqlens, output_final_state,
                                                          True)
        ctx.save_for_backward(q, k, v, g, ws, initial_state, cu_seqlens)
        ctx.mark_non_differentiable(ws)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, ws, initial_state, cu_seqlens = ctx.saved_tensors
        if dfinal is not None and dfinal.numel() == 0:
            dfinal = None
        dq, dk, dv, dg, dh0 = eager_or_op(_bwd, _diag_bwd_op, do)(
            q, k, v, g, do, ws, initial_state, dfinal, cu_seqlens)
        return dq, dk, dv, dg, (dh0 if initial_state is not None else None), None, None


def gated_diag(a: DiagArgs):
    args = (a.q, a.k, a.v, a.g, a.initial_state, a.cu_seqlens, a.output_final_state)
    if a.needs_grad():
        o, final = GatedDiagFunction.apply(*args)
    else:
        o, final, _ = eager_or_op(_fwd, _diag_fwd_op)(*args)
    return o, (final if a.output_final_state else None)


def gated_diag_step(a: DiagArgs):
    return eager_or_op(_step, _diag_step_op)(a.q, a.k, a.v, a.g, a.state, a.state_indices, a.num_accepted_tokens)
