"""A fast reference for long sequences (``delta_attn.reference.gated_diag_scan``): gated diagonal
attention and its gradients by a log-depth (Hillis-Steele) scan in plain PyTorch, in any dtype
(float64 for the ground truth).

``reference.gated_diag`` is the specification but runs a Python loop over time; this one runs
``log2(T)`` vectorised steps, so 1M-token sequences can be checked on a GPU. Gradients are the
closed form of the recurrence (``ds_t = exp(g_{t+1}) ds_{t+1} + do_t q_t``, ``dq = do s``,
``dk = ds v``, ``dv = ds k``, ``dg = ds exp(g_t) s_{t-1}``, ``ds0 = exp(g_first) ds_first``); the
CPU tests check them against autograd through the specification. Sequence starts (and, in the reverse
scan, sequence ends) are resets applied by a select, so a NaN or an inf of one sequence never reaches
another (``0 * NaN`` is NaN): the specification's per-sequence semantics, non-finite values included.
"""
from __future__ import annotations

from typing import Optional

import torch


def _scan(a: torch.Tensor, b: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
    """s_t = a_t s_{t-1} + b_t along dim 0 from s_{-1} = 0, and s_t = b_t where ``reset`` (a bool per row)."""
    a, b = a.clone(), b.clone()
    r = reset.reshape(-1, *([1] * (a.dim() - 1))).expand_as(a).clone()
    off, n = 1, a.shape[0]
    while off < n:
        b[off:] = torch.where(r[off:], b[off:], a[off:] * b[:-off] + b[off:])
        a[off:] = a[off:] * a[:-off]
        r[off:] = r[off:] | r[:-off]
        off *= 2
    return b


def _segments(total: int, t_seq: int, cu: Optional[torch.Tensor], device):
    t = torch.arange(total, device=device)
    if cu is None:
        seq = t // max(t_seq, 1)
        return seq, t % max(t_seq, 1) == 0, t % max(t_seq, 1) == t_seq - 1
    cu = cu.long()
    seq = torch.searchsorted(cu[1:], t, right=True)
    return seq, t == cu[seq], t == cu[seq + 1] - 1


def gated_diag_scan(q, k, v, g, initial_state=None, cu_seqlens=None, do=None, dfinal=None,
                    dtype=torch.float64):
    """Returns ``(o, final_state, grads)`` computed in ``dtype``; ``grads`` is None without ``do``,
    else ``(dq, dk, dv, dg, d_initial_state or None)``. Shapes as ``delta_attn.gated_diag_attn``."""
    b_, t_, h, d = q.shape
    n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else b_
    total = b_ * t_
    qf, kf, vf, gf = (x.reshape(total, h * d).to(dtype) for x in (q, k, v, g))
    seq, start, end = _segments(total, t_, cu_seqlens, q.device)
    s0 = (initial_state.reshape(n, h * d).to(dtype) if initial_state is not None
          else torch.zeros(n, h * d, dtype=dtype, device=q.device))
    decay = gf.exp()
    kv = kf * vf
    st = start[:, None]
    s = _scan(decay, kv + torch.where(st, decay * s0[seq], torch.zeros_like(kv)), start)
    o = (qf * s).reshape(q.shape)
    final = s0.clone()
    final[seq[end]] = s[end]
    final = final.reshape(n, h, d)
    if do is None:
        return o, final, None
    dof = do.reshape(total, h * d).to(dtype)
    beta = dof * qf
    if dfinal is not None:
        dht = dfinal.reshape(n, h * d).to(dtype)
        beta = beta + torch.where(end[:, None], dht[seq], torch.zeros_like(beta))
    a_next = torch.cat([decay[1:], torch.zeros_like(decay[:1])], 0)
    ds = _scan(a_next.flip(0), beta.flip(0), end.flip(0)).flip(0)
    s_prev = torch.cat([torch.zeros_like(s[:1]), s[:-1]], 0)
    s_prev = torch.where(st, s0[seq], s_prev)
    grads = [dof * s, ds * vf, ds * kf, ds * decay * s_prev]
    grads = [x.reshape(q.shape) for x in grads]
    dh0 = None
    if initial_state is not None:
        dh0 = dfinal.reshape(n, h * d).to(dtype).clone() if dfinal is not None else torch.zeros_like(s0)
        dh0[seq[start]] = (decay * ds)[start]
        dh0 = dh0.reshape(n, h, d)
    return o, final, (*grads, dh0)
