"""delta-attn's flash attention as an ``attn_implementation`` of Hugging Face transformers.

>>> from delta_attn.integrations.transformers import register
>>> name = register()              # "delta_attn"; register(name="...", backend="torch") for another backend
>>> # model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
>>> # or: model.set_attn_implementation(name)

The attention function is registered in transformers' ``AttentionInterface`` and its mask function
(the un-padded 2-D mask flash-attention models use) in ``AttentionMaskInterface``, under the same
name. It handles what the flash-attention path of transformers handles:
- no mask: one dense :func:`delta_attn.flash_attn_func` call (causal aligned bottom-right, so
  decoding with a KV cache needs no mask);
- a padding mask (B, Sk): real queries and keys are packed and run through
  :func:`delta_attn.flash_attn_varlen_func` (padded query rows return 0);
- packed sequences (B == 1), given by ``cu_seq_lens_q/k`` keyword arguments or by position ids that
  restart: one varlen call;
- ``scaling``, ``sliding_window`` (window ``sliding_window - 1`` to the left), ``softcap``, dropout, GQA.
Needs transformers >= 4.53 (``masking_utils.AttentionMaskInterface``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..nn.attention import _masked_attention
from ..ops.flash.api import flash_attn_varlen_func

DEFAULT_NAME = "delta_attn"


def _packed_cu_seqlens(kwargs: dict, position_ids: Optional[torch.Tensor], batch: int, sq: int, sk: int):
    """(cu_q, cu_k, max_q, max_k) for a packed B == 1 batch, or None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(max_q) if max_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_k) if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
        return cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k
    if position_ids is None or batch != 1 or sq == 1 or sq != sk or position_ids.shape[-1] != sq:
        return None
    pos = position_ids.reshape(-1)
    if torch.compiler.is_compiling():
        return None
    if bool((pos[1:] >= pos[:-1]).all()):
        return None      # one increasing sequence: not packed
    starts = (pos == pos.min()).nonzero().view(-1).to(torch.int32)
    cu = torch.cat((starts, torch.tensor([sq], dtype=torch.int32, device=pos.device)))
    max_len = int((cu[1:] - cu[:-1]).max())
    return cu, cu, max_len, max_len


def make_attention_forward(backend: str = "auto") -> Callable:
    """An attention function with transformers' signature that runs delta-attn on ``backend``."""

    def delta_attn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                     value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                     dropout: float = 0.0, scaling: Optional[float] = None,
                                     sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                                     is_causal: Optional[bool] = None, **kwargs):
        """query (B, Hq, Sq, D), key/value (B, Hk, Sk, D) -> ((B, Sq, Hq, Dv), None)."""
        if kwargs.get("output_attentions", False):
            raise ValueError("the delta_attn attention implementation cannot return attention weights "
                             "(output_attentions=True); use attn_implementation='eager' for that")
        if kwargs.get("s_aux") is not None:
            raise ValueError("the delta_attn attention implementation does not support attention sinks (s_aux)")
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        kw = dict(causal=causal, softmax_scale=scaling, dropout_p=float(dropout),
                  softcap=float(softcap) if softcap else 0.0,
                  window_size=(sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1))
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("the delta_attn attention implementation takes a 2-D padding mask (B, Sk) as "
                             f"flash-attention models build it, got a {attention_mask.dim()}-D mask: load the "
                             "model with attn_implementation set to the name register() returned")
        if attention_mask is None:
            packed = _packed_cu_seqlens(kwargs, kwargs.get("position_ids"), b, sq, sk)
            if packed is not None:
                cu_q, cu_k, max_q, max_k = packed
                out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, backend=backend, **kw)
                return out.unsqueeze(0), None
            return _masked_attention(q, k, v, None, None, backend, **kw), None
        kmask = attention_mask[:, -sk:].bool()
        if kmask.shape[1] < sk:
            # a static cache: its first mask-length slots are the keys filled so far
            k, v, sk = k[:, :kmask.shape[1]], v[:, :kmask.shape[1]], kmask.shape[1]
        # the queries are the last Sq positions of the mask; a single query is always real (with a
        # static cache the mask's last slots are still empty while decoding)
        qmask = None if sq == 1 else kmask[:, -sq:]
        return _masked_attention(q, k, v, qmask, kmask, backend, **kw), None

    delta_attn_attention_forward.backend = backend
    return delta_attn_attention_forward


def register(name: str = DEFAULT_NAME, backend: str = "auto") -> str:
    """Register delta-attn under ``name`` for ``attn_implementation=name``; returns ``name``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as e:   # pragma: no cover - depends on the installed version
        from .. import _install
        raise ImportError("delta_attn.integrations.transformers needs transformers >= 4.53: "
                          f"{_install.TRANSFORMERS}") from e
    AttentionInterface.register(name, make_attention_forward(backend))
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
