"""``backend="triton"`` for KDA: the ``torch.library`` custom ops (with fake implementations), their
autograd, and the backend entry points (the pattern of every op, docs/ARCHITECTURE.md).

* custom ops: ``delta_attn::kda_infer`` (inference prefill), ``delta_attn::kda_train`` (the training forward,
  which returns what its backward needs), ``delta_attn::kda_train_bwd`` and ``delta_attn::kda_step`` (decode);
* :class:`KDAFunction`: autograd, ``kda_train`` forward and ``kda_train_bwd`` backward (the ops' bodies in eager
  mode, the ops while torch.compile traces: ``eager_or_op``);
* the backend entries: :func:`kda` takes the Function when a gradient is needed, else the inference op's body
  in eager mode (the op while torch.compile traces); :func:`kda_step` the decode op's body the same way.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .._launch import eager_or_op
from .args import KDAArgs
from .launch import (TRAIN_CHUNK, Saved, decode_step, infer_forward, kd_dtype, max_chunks, precision,
                     train_backward, train_forward)

_Opt = Optional[torch.Tensor]


def _empty(q):
    return q.new_empty(0, dtype=torch.float32)


def _infer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           initial_state: _Opt, cu_seqlens: _Opt, A_log: _Opt, dt_bias: _Opt, scale: float,
           lower_bound: Optional[float], use_qk_l2norm: bool, output_final_state: bool,
           allow_tf32: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    o, final = infer_forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound,
                             use_qk_l2norm, output_final_state, allow_tf32)
    return o, (final if final is not None else _empty(q))


_kda_infer_op = torch.library.custom_op("delta_attn::kda_infer", _infer, mutates_args=())


def _fake_outputs(q, v, cu_seqlens, output_final_state):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty(N, HV, K, V, dtype=torch.float32) if output_final_state else _empty(q)
    return v.new_empty(B, T, HV, V), final


@_kda_infer_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
      output_final_state, allow_tf32):
    return _fake_outputs(q, v, cu_seqlens, output_final_state)


def _train(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           initial_state: _Opt, cu_seqlens: _Opt, A_log: _Opt, dt_bias: _Opt, scale: float,
           lower_bound: Optional[float], use_qk_l2norm: bool, output_final_state: bool,
           allow_tf32: bool) -> List[torch.Tensor]:
    o, final, saved = train_forward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale,
                                    lower_bound, use_qk_l2norm, output_final_state, allow_tf32)
    return [o, final if final is not None else _empty(q), *saved]


_kda_train_op = torch.library.custom_op("delta_attn::kda_train", _train, mutates_args=())


@_kda_train_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
      output_final_state, allow_tf32):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    R, nc = B * T, max_chunks(B, T, N, cu_seqlens is not None)
    work = precision(q.dtype, allow_tf32, q.shape[-1]).work
    f32 = torch.float32
    new = lambda *shape, dtype=work: q.new_empty(*shape, dtype=dtype)      # noqa: E731
    saved = Saved(W=new(R, HV, K), QG=new(R, HV, K), KD=new(R, HV, K, dtype=kd_dtype(q, v, work, True)),
                  AQK=new(R, HV, TRAIN_CHUNK), TM=new(R, HV, TRAIN_CHUNK, dtype=f32), GC=new(nc, HV, K, dtype=f32),
                  HS=new(nc, HV, K, V), VNEW=new(R, HV, V))
    return [*_fake_outputs(q, v, cu_seqlens, output_final_state), *saved]


def _train_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial_state: _Opt, cu_seqlens: _Opt, A_log: _Opt, dt_bias: _Opt, saved: List[torch.Tensor],
               do: torch.Tensor, dht: _Opt, scale: float, lower_bound: Optional[float], use_qk_l2norm: bool,
               allow_tf32: bool) -> List[torch.Tensor]:
    grads = train_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, Saved(*saved), do, dht,
                           scale, lower_bound, use_qk_l2norm, allow_tf32)
    return [t if t is not None else _empty(q) for t in grads]


_kda_train_bwd_op = torch.library.custom_op("delta_attn::kda_train_bwd", _train_bwd, mutates_args=())


@_kda_train_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, saved, do, dht, scale, lower_bound,
      use_qk_l2norm, allow_tf32):
    e = _empty(q)
    # the real op returns contiguous tensors whatever the inputs' strides: so must the fake
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape),
            initial_state.new_empty(initial_state.shape, dtype=torch.float32) if initial_state is not None else e,
            A_log.new_empty(A_log.shape, dtype=torch.float32) if A_log is not None else e,
            dt_bias.new_empty(dt_bias.shape, dtype=torch.float32) if dt_bias is not None else e]


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          state: torch.Tensor, state_indices: _Opt, A_log: _Opt, dt_bias: _Opt, scale: float,
          lower_bound: Optional[float], use_qk_l2norm: bool, num_accepted_tokens: _Opt = None) -> torch.Tensor:
    return decode_step(q, k, v, g, beta, state, state_indices, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
                       num_accepted_tokens)


_kda_step_op = torch.library.custom_op("delta_attn::kda_step", _step, mutates_args=("state",))


@_kda_step_op.register_fake
def _(q, k, v, g, beta, state, state_indices, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
      num_accepted_tokens=None):
    return v.new_empty(v.shape)


class KDAFunction(torch.autograd.Function):
    """Autograd of the Triton KDA: the training forward and its backward custom ops."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, scale, lower_bound, use_qk_l2norm,
                output_final_state, allow_tf32):
        o, final, *saved = eager_or_op(_train, _kda_train_op, q)(q, k, v, g, beta, initial_state, cu_seqlens, A_log,
                                                                 dt_bias, scale, lower_bound, use_qk_l2norm,
                                                                 output_final_state, allow_tf32)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, *saved)
        ctx.opts = (scale, lower_bound, use_qk_l2norm, output_final_state, allow_tf32)
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, *saved = ctx.saved_tensors
        scale, lower_bound, use_qk_l2norm, output_final_state, allow_tf32 = ctx.opts
        if not output_final_state or dht is None or dht.numel() == 0:
            dht = None
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, dg, db, dh0, dal, ddt = eager_or_op(_train_bwd, _kda_train_bwd_op, do)(
            q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, saved, do, dht, scale, lower_bound,
            use_qk_l2norm, allow_tf32)
        dh0 = dh0.to(initial_state.dtype) if initial_state is not None else None
        dal = dal.to(A_log.dtype) if A_log is not None else None
        ddt = ddt.to(dt_bias.dtype) if dt_bias is not None else None
        return dq, dk, dv, dg, db, dh0, None, dal, ddt, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# backend entry points (receive the validated KDAArgs)
# ------------------------------------------------------------------------------------------------

def kda(a: KDAArgs):
    args = (a.q, a.k, a.v, a.g, a.beta, a.initial_state, a.cu_seqlens, a.A_log, a.dt_bias, float(a.scale),
            a.lower_bound, bool(a.use_qk_l2norm), bool(a.output_final_state), bool(a.allow_tf32))
    if a.needs_grad():
        o, final = KDAFunction.apply(*args)
    else:
        o, final = eager_or_op(_infer, _kda_infer_op)(*args)
    return o, (final if a.output_final_state else None)


def kda_step(a: KDAArgs):
    return eager_or_op(_step, _kda_step_op)(a.q, a.k, a.v, a.g, a.beta, a.state, a.state_indices, a.A_log,
                                            a.dt_bias, float(a.scale), a.lower_bound, bool(a.use_qk_l2norm),
                                            a.num_accepted_tokens)
