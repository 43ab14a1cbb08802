"""The dense transformer family (llama, qwen2, qwen3, gemma3) from one config-driven model."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from specserve.cache.kv import KVCache
from specserve.models.batch import FlatBatch
from specserve.models.config import ModelConfig
from specserve.models.layers.attention import Attention
from specserve.models.layers.basic import GatedMLP, RMSNorm, RotaryEmbedding


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.attn_norm = RMSNorm(cfg.hidden_size, eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation)
        # gemma: norms on the branch outputs too ("sandwich"); identity elsewhere
        sandwich = cfg.sandwich_norm
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps) if sandwich else nn.Identity()
        self.post_ffn_norm = RMSNorm(cfg.hidden_size, eps) if sandwich else nn.Identity()

    def forward(self, x: torch.Tensor, batch: FlatBatch, cache: KVCache) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), batch, cache))
        return x + self.post_ffn_norm(self.mlp(self.ffn_norm(x)))


class DenseTransformer(nn.Module):
    """forward(tokens [T], batch) -> hidden [T, hidden]; logits(hidden [N, hidden]) -> [N, V]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        # layers with the same rope settings share one module, so its tables are made once
        # per forward instead of once per layer
        ropes: dict[tuple[float, float], RotaryEmbedding] = {}
        for block in self.layers:
            attn = cast(Block, block).attn
            attn.rope = ropes.setdefault((attn.rope.theta, attn.rope.scale), attn.rope)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed.weight

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        p = self.embed.weight
        cfg = self.cfg
        return KVCache(
            cfg.num_layers, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim, p.dtype, p.device
        )

    def forward(self, tokens: torch.Tensor, batch: FlatBatch, cache: KVCache) -> torch.Tensor:
        cache.check_room(batch)
        x = self.embed(tokens)
        if self.cfg.embed_scale != 1.0:
            # the scale is rounded to the activation dtype first, as transformers does
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        for block in self.layers:
            x = block(x, batch, cache)
        cache.advance(batch)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
