"""A small decoder-only language model mixing linear and full attention (Kimi Linear's 3:1 hybrid).

``HybridConfig.pattern`` is cycled over the layers: ``K`` = :class:`KimiDeltaAttention`, ``D`` =
:class:`GatedDiagonalAttention`, ``A`` = :class:`MultiheadAttention` (causal, GQA, rotary). Each
block is pre-norm: ``x + mixer(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``.

>>> import torch
>>> from delta_attn.nn import HybridConfig, HybridLM
>>> model = HybridLM(HybridConfig(vocab_size=32, hidden_size=32, num_layers=4, num_heads=2, backend="torch"))
>>> model(torch.randint(0, 32, (2, 6))).shape
torch.Size([2, 6, 32])
>>> model.generate(torch.randint(0, 32, (2, 6)), max_new_tokens=3).shape
torch.Size([2, 3])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._utils import RMSNorm
from .attention import MultiheadAttention
from .cache import KVCache, RecurrentCache
from .linear_attention import GatedDiagonalAttention, KimiDeltaAttention

LAYER_TYPES = {"K": "kda", "D": "diag", "A": "attention"}


@dataclass
class HybridConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: Optional[int] = None      # attention layers (GQA); None: num_heads
    head_dim: Optional[int] = None          # None: hidden_size // num_heads
    pattern: str = "KKKA"                   # cycled over the layers: K (KDA), D (diagonal), A (attention)
    intermediate_size: Optional[int] = None  # SwiGLU width; None: 8/3 * hidden, rounded up to 8
    conv_size: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    backend: str = "auto"

    def layer_types(self) -> List[str]:
        bad = sorted(set(self.pattern) - set(LAYER_TYPES))
        if not self.pattern or bad:
            raise ValueError(f"pattern must be a non-empty string of K (KDA), D (diagonal), A (attention), "
                             f"got {self.pattern!r}")
        return [LAYER_TYPES[self.pattern[i % len(self.pattern)]] for i in range(self.num_layers)]


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class HybridBlock(nn.Module):
    def __init__(self, cfg: HybridConfig, kind: str, idx: int):
        super().__init__()
        self.kind = kind
        common = dict(head_dim=cfg.head_dim, backend=cfg.backend, layer_idx=idx)
        if kind == "attention":
            self.mixer = MultiheadAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                            rope_theta=cfg.rope_theta, **common)
        elif kind == "kda":
            self.mixer = KimiDeltaAttention(cfg.hidden_size, cfg.num_heads, conv_size=cfg.conv_size,
                                            norm_eps=cfg.norm_eps, **common)
        else:
            self.mixer = GatedDiagonalAttention(cfg.hidden_size, cfg.num_heads, conv_size=cfg.conv_size,
                                                norm_eps=cfg.norm_eps, **common)
        inner = cfg.intermediate_size or -(-(8 * cfg.hidden_size // 3) // 8) * 8
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, inner)

    def new_cache(self) -> Union[KVCache, RecurrentCache]:
        return KVCache() if self.kind == "attention" else RecurrentCache()

    def forward(self, x, **kw):
        x = x + self.mixer(self.norm1(x), **kw)
        return x + self.mlp(self.norm2(x))


@dataclass
class HybridCache:
    """One cache per layer (:class:`KVCache` or :class:`RecurrentCache`), filled in place."""
    layers: list = field(default_factory=list)

    def reorder(self, index: torch.Tensor) -> None:
        for c in self.layers:
            c.reorder(index)


class HybridLM(nn.Module):
    """Decoder LM: embeddings -> hybrid blocks -> RMSNorm -> LM head (tied to the embeddings by default).

    ``forward(input_ids (B, T), attention_mask=None, cu_seqlens=None, max_seqlen=None, cache=None)``
    returns logits (B, T, vocab); the keyword arguments have the layers' meaning (padding mask,
    packed varlen batch with B == 1, a :class:`HybridCache` continued and updated in place).
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(HybridBlock(config, kind, i) for i, kind in enumerate(config.layer_types()))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_cache(self) -> HybridCache:
        return HybridCache([blk.new_cache() for blk in self.blocks])

    def forward(self, input_ids: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                cache: Optional[HybridCache] = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for i, blk in enumerate(self.blocks):
            x = blk(x, attention_mask=attention_mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                    cache=None if cache is None else cache.layers[i])
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *,
                 attention_mask: Optional[torch.Tensor] = None, temperature: float = 0.0,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Prefill the prompt once, then decode ``max_new_tokens`` tokens one at a time from the caches.

        ``attention_mask`` (B, T) allows padded prompts (either side). Greedy when ``temperature``
        is 0, else sampling. Returns the new tokens (B, max_new_tokens).
        """
        cache = self.new_cache()
        logits = self(input_ids, attention_mask=attention_mask, cache=cache)
        if attention_mask is None:
            last = logits[:, -1]
        else:   # the last real token of each row
            pos = torch.arange(input_ids.shape[1], device=input_ids.device)
            idx = (attention_mask.bool() * (pos + 1)).argmax(1)
            last = logits[torch.arange(logits.shape[0], device=logits.device), idx]
        out = []
        for i in range(max_new_tokens):
            if temperature > 0:
                nxt = torch.multinomial(torch.softmax(last.float() / temperature, -1), 1, generator=generator)
            else:
                nxt = last.argmax(-1, keepdim=True)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                last = self(nxt, cache=cache)[:, -1]
        return torch.cat(out, 1) if out else input_ids.new_zeros(input_ids.shape[0], 0)
