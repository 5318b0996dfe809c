"""Layers for models built on the delta-attn operators.

Every layer takes ``backend=`` ("auto" by default) and passes it to the operators, so the same
module runs the Triton / cuDNN kernels on a GPU and the ``torch`` reference path anywhere else.

- :class:`MultiheadAttention`: causal self-attention, GQA, rotary, padding mask or ``cu_seqlens``, KV cache
- :class:`GQACrossAttention`: queries from the input, keys/values from a memory
- :class:`KimiDeltaAttention`: the KDA layer of Kimi Linear (short conv, gated delta rule, gated RMSNorm)
- :class:`GatedDiagonalAttention`: the same layer around gated diagonal attention
- :class:`HybridLM`: a small decoder LM mixing those layers (3 linear : 1 attention by default), with
  cached ``generate``

Caches are dataclasses (:class:`KVCache`, :class:`PagedKVCache`, :class:`RecurrentCache`,
:class:`CrossAttentionCache`) updated in place: pass an empty one to the prefill call and the same
object to every later call.

``torch.compile(model, fullgraph=True)`` traces dense batches (training forward/backward and
decoding steps from the caches) without graph breaks. Padded batches (``attention_mask``) pack their
real tokens with ``nonzero`` (a data-dependent shape) and varlen batches on the ``torch`` backend
read ``cu_seqlens`` on the host: both graph-break under compile.
"""
from .attention import GQACrossAttention, MultiheadAttention
from .cache import CrossAttentionCache, KVCache, PagedKVCache, RecurrentCache
from .linear_attention import GatedDiagonalAttention, KimiDeltaAttention
from ._utils import RMSNorm, RotaryEmbedding, ShortConvolution
from .hybrid import HybridCache, HybridConfig, HybridLM

__all__ = [
    "MultiheadAttention", "GQACrossAttention", "KimiDeltaAttention", "GatedDiagonalAttention",
    "KVCache", "PagedKVCache", "RecurrentCache", "CrossAttentionCache", "RMSNorm", "RotaryEmbedding",
    "ShortConvolution",
    "HybridConfig", "HybridLM", "HybridCache",
]
