"""``backend="torch"`` for KDA: the reference recurrence."""
from __future__ import annotations

from ... import reference
from .._state import step_on_pool
from .args import KDAArgs


def _run(a: KDAArgs, q, k, v, g, beta, initial_state, output_final_state):
    return reference.kda(q, k, v, g, beta, scale=a.scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=a.cu_seqlens,
                         use_qk_l2norm=a.use_qk_l2norm, A_log=a.A_log, dt_bias=a.dt_bias,
                         lower_bound=a.lower_bound)


def kda(a: KDAArgs):
    return _run(a, a.q, a.k, a.v, a.g, a.beta, a.initial_state, a.output_final_state)


def kda_step(a: KDAArgs):
    return step_on_pool(a.state, a.state_indices, a.num_accepted_tokens, a.q.shape[1],
                        lambda s0, ts: _run(a, a.q[:, ts], a.k[:, ts], a.v[:, ts], a.g[:, ts], a.beta[:, ts], s0,
                                            True))
