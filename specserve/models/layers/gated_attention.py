"""Gated full attention of Qwen3-Next / Qwen3.5.

Differences from the dense family's Attention: the q projection also yields a per-head
output gate (rows interleaved per head: [q_h | gate_h]), the output is multiplied by
sigmoid(gate) before o, and rotary embedding covers only the first `rotary_dim` dims of
each head ("partial rotary").
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.batch import FlatBatch
from specserve.cache.kv import KVCache
from specserve.models.config import HybridConfig
from specserve.models.layers.basic import RMSNorm, RotaryEmbedding, apply_rotary
from specserve.ops.naive.attention import cached_attention


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, R] with R <= D: rotate the first R dims, pass the rest."""
    rot = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: HybridConfig, kv_index: int) -> None:
        """kv_index: which KV cache layer this attention layer owns."""
        super().__init__()
        self.kv_index = kv_index
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        hd = self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q = nn.Linear(cfg.hidden_size, 2 * cfg.num_heads * hd, bias=bias)
        self.k = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=bias)
        self.v = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=bias)
        self.o = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        assert cfg.query_scale is not None
        self.scale = cfg.query_scale

    def forward(self, x: torch.Tensor, batch: FlatBatch, cache: KVCache) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; writes this layer's new K/V into the cache."""
        T, hd = x.shape[0], self.head_dim
        q, gate = self.q(x).view(T, self.num_heads, 2 * hd).split(hd, dim=-1)
        cos, sin = self.rope.cos_sin(batch.positions, x.dtype, batch.end)
        q = apply_partial_rotary(self.q_norm(q), cos, sin)
        self.store_kv(x, batch, cache)
        o = cached_attention(q, cache.k[self.kv_index], cache.v[self.kv_index], batch, self.scale)
        return self.o(o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1)))

    def store_kv(self, x: torch.Tensor, batch: FlatBatch, cache: KVCache) -> None:
        """Write the K/V of x's rows [T, hidden] into the cache (all `forward` writes): for
        rows whose attention output nobody reads, this is all a row needs."""
        T, hd = x.shape[0], self.head_dim
        k = self.k_norm(self.k(x).view(T, self.num_kv_heads, hd))
        v = self.v(x).view(T, self.num_kv_heads, hd)
        cos, sin = self.rope.cos_sin(batch.positions, x.dtype, batch.end)
        cache.write(self.kv_index, batch, apply_partial_rotary(k, cos, sin), v)
