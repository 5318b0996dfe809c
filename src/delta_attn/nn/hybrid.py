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

``generate`` keeps the attention layers' keys and values in a :class:`PagedKVCache` and, on CUDA,
replays one captured decode step (embedding -> layers -> logits -> next token) per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._utils import RMSNorm
from .attention import MultiheadAttention
from .cache import KVCache, PagedKVCache, RecurrentCache
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

    def new_cache(self, max_seqlen: Optional[int] = None, page_size: int = 256
                  ) -> Union[KVCache, PagedKVCache, RecurrentCache]:
        if self.kind != "attention":
            return RecurrentCache()
        return KVCache() if max_seqlen is None else PagedKVCache(max_seqlen, page_size)

    def forward(self, x, **kw):
        x = x + self.mixer(self.norm1(x), **kw)
        return x + self.mlp(self.norm2(x))


@dataclass
class HybridCache:
    """One cache per layer (:class:`KVCache` / :class:`PagedKVCache` or :class:`RecurrentCache`),
    filled in place."""
    layers: list = field(default_factory=list)

    def reorder(self, index: torch.Tensor) -> None:
        for c in self.layers:
            c.reorder(index)

    def reserve(self, num_tokens: int) -> None:
        """Hand out the pages of the paged layers for ``num_tokens`` more tokens per sequence (host side;
        call before capturing a step that will be replayed that many times)."""
        for c in self.layers:
            if isinstance(c, PagedKVCache):
                c.reserve(num_tokens)


def _check_new_tokens(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {n!r}")


def _next_token(logits: torch.Tensor, temperature: float, noise: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, V) logits -> (B, 1) token: argmax, or Gumbel-max sampling with uniform ``noise`` (B, V)
    (a sample of softmax(logits / temperature), drawn without a host synchronisation)."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    gumbel = -torch.log(-torch.log(noise.clamp(min=torch.finfo(noise.dtype).tiny)))
    return (logits.float() / temperature + gumbel).argmax(-1, keepdim=True)


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

    def new_cache(self, max_seqlen: Optional[int] = None, page_size: int = 256) -> HybridCache:
        """Empty caches; with ``max_seqlen`` the attention layers get a :class:`PagedKVCache` of that many
        tokens per sequence (pages of ``page_size`` tokens), else a growing :class:`KVCache`."""
        return HybridCache([blk.new_cache(max_seqlen, page_size) for blk in self.blocks])

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
                 generator: Optional[torch.Generator] = None, paged: bool = True, page_size: int = 256,
                 cuda_graph: Union[bool, str] = "auto") -> torch.Tensor:
        """Prefill the prompt once, then decode ``max_new_tokens`` tokens one at a time from the caches.

        ``attention_mask`` (B, T) allows padded prompts (either side). Greedy when ``temperature``
        is 0, else sampling (Gumbel-max with uniform noise from ``generator``). Returns the new tokens
        (B, max_new_tokens).

        ``paged``: the attention layers keep a :class:`PagedKVCache` of ``page_size``-token pages sized
        for prompt + new tokens (else a growing :class:`KVCache`). ``cuda_graph``: after the eager
        prefill and one eager decode step (the warm-up), capture one decode step in a
        ``torch.cuda.CUDAGraph`` and replay it for the remaining tokens; it needs CUDA, the paged cache
        and capturable operators (backend ``auto`` / ``triton``), and a model in its compute dtype (no
        autocast). ``"auto"``: on when all of that holds. Both paths give the same tokens.
        """
        cache, last = self.prefill(input_ids, max_new_tokens, attention_mask=attention_mask, paged=paged,
                                   page_size=page_size)
        return self.decode(cache, last, max_new_tokens, temperature=temperature, generator=generator,
                           cuda_graph=cuda_graph)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, max_new_tokens: int, *,
                attention_mask: Optional[torch.Tensor] = None, paged: bool = True, page_size: int = 256):
        """Eager forward of the prompt into new caches (paged ones sized for ``max_new_tokens`` more
        tokens). Returns ``(cache, logits of each row's last real token (B, vocab))``."""
        _check_new_tokens(max_new_tokens)
        b, t = input_ids.shape
        cache = self.new_cache(t + max_new_tokens, page_size) if paged else self.new_cache()
        logits = self(input_ids, attention_mask=attention_mask, cache=cache)
        if attention_mask is None:
            return cache, logits[:, -1]
        pos = torch.arange(t, device=input_ids.device)    # the last real token of each row
        idx = (attention_mask.bool() * (pos + 1)).argmax(1)
        return cache, logits[torch.arange(b, device=logits.device), idx]

    @torch.no_grad()
    def decode(self, cache: HybridCache, logits: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
               generator: Optional[torch.Generator] = None, cuda_graph: Union[bool, str] = "auto") -> torch.Tensor:
        """Pick a token from ``logits`` (B, vocab), then feed each picked token through the caches:
        ``max_new_tokens`` tokens (B, max_new_tokens). ``cuda_graph`` as in :meth:`generate`."""
        _check_new_tokens(max_new_tokens)
        paged = any(isinstance(c, PagedKVCache) for c in cache.layers) or "A" not in self.config.pattern
        on_cuda = logits.is_cuda
        if cuda_graph == "auto":
            cuda_graph = on_cuda and paged and self.config.backend != "torch" and not torch.is_autocast_enabled()
        elif not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph must be True, False or 'auto', got {cuda_graph!r}")
        elif cuda_graph and not (on_cuda and paged):
            raise ValueError(f"cuda_graph=True needs CUDA inputs and paged=True, got device {logits.device} and "
                             f"paged={paged}")
        b = logits.shape[0]
        noise = None
        if temperature > 0:
            noise = torch.empty(b, logits.shape[-1], device=logits.device, dtype=torch.float32)

        def pick(logits_last: torch.Tensor) -> torch.Tensor:
            if noise is not None:
                noise.uniform_(generator=generator)
            return _next_token(logits_last, temperature, noise)

        out = [pick(logits)] if max_new_tokens else []
        step: Callable[[torch.Tensor], torch.Tensor] = lambda tok: self(tok, cache=cache)[:, -1]   # noqa: E731
        if cuda_graph and max_new_tokens > 2:
            out.append(pick(self._graph_warmup(step, out[-1])))
            out += self._graph_decode(step, cache, out[-1], max_new_tokens - 2, temperature, noise, generator)
        else:
            for _ in range(max_new_tokens - 1):
                out.append(pick(step(out[-1])))
        return torch.cat(out, 1) if out else logits.new_zeros(b, 0, dtype=torch.long)

    @staticmethod
    def _graph_warmup(step, tok: torch.Tensor) -> torch.Tensor:
        """One real decode step, eagerly on a side stream (compiles the kernels, sets up workspaces)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = step(tok)
        torch.cuda.current_stream().wait_stream(side)
        return logits

    @staticmethod
    def _graph_decode(step, cache: HybridCache, tok: torch.Tensor, n: int, temperature: float,
                      noise: Optional[torch.Tensor], generator) -> List[torch.Tensor]:
        """Capture step -> next token once on static buffers, replay it ``n`` times."""
        cache.reserve(n)                       # every page the replays write, handed out before capture
        static_tok = tok.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            nxt = _next_token(step(static_tok), temperature, noise)
            static_tok.copy_(nxt)              # the next replay reads this step's token
        out = []
        for _ in range(n):
            if noise is not None:
                noise.uniform_(generator=generator)
            graph.replay()
            out.append(static_tok.clone())
        return out
