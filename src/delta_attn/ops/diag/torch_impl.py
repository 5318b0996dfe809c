"""``backend="torch"`` for gated diagonal attention: the reference recurrence."""
from __future__ import annotations

from ... import reference
from .._state import step_on_pool
from .args import DiagArgs


def gated_diag(a: DiagArgs):
    return reference.gated_diag(a.q, a.k, a.v, a.g, initial_state=a.initial_state,
                                output_final_state=a.output_final_state, cu_seqlens=a.cu_seqlens)


def gated_diag_step(a: DiagArgs):
    return step_on_pool(a.state, a.state_indices, a.num_accepted_tokens, a.q.shape[1],
                        lambda s0, ts: reference.gated_diag(a.q[:, ts], a.k[:, ts], a.v[:, ts], a.g[:, ts],
                                                            initial_state=s0, output_final_state=True))
