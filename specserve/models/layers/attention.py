"""Self-attention with grouped KV heads, optional qkv bias, q/k norm and sliding window."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specserve.batch import FlatBatch
from specserve.cache.kv import KVCache
from specserve.models.config import ModelConfig
from specserve.models.layers.basic import RMSNorm, RotaryEmbedding, apply_rotary
from specserve.models.layers.lowbit_fused import joint_output
from specserve.ops.cpu.build import kernels_for
from specserve.ops.fast.attention import cached_attention

# a one-layer head's catch-up only stores the K/V of the rows before each last one
# (`store_kv`) from this many such rows on: for fewer, the extra calls cost more than the
# rows' MLP saved (docs/perf/2026-11-29-head-catch-up.md)
STORE_ONLY_FROM = 2


def store_before_last(
    batch: FlatBatch, cache: KVCache, store: Callable[[list[int], FlatBatch], None]
) -> FlatBatch | None:
    """A one-layer head's catch-up: `store(rows, before)` writes the K/V of the rows before
    each sequence's last (their indices in `batch`, and as a batch of their own), the cache
    then holds them, and the batch of the last rows is returned for the whole layer. None
    where fewer than STORE_ONLY_FROM rows come before the last ones: nothing is stored, and
    the whole layer runs over `batch`."""
    if batch.num_tokens - batch.num_seqs < STORE_ONLY_FROM:
        return None
    before, early, last = batch.split_last()
    assert before is not None
    cache.check_room(before)
    store(early, before)
    cache.advance(before)
    return last


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        hd = cfg.head_dim
        self.q = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.attention_bias)
        self.k = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = RotaryEmbedding(hd, *cfg.layer_rope(layer))
        self.window = cfg.layer_window(layer)
        assert cfg.query_scale is not None
        self.scale = cfg.query_scale
        self.per_row = False  # batch-invariant mode (see models/layers/invariant.py)
        # ops/cpu/attention.cpp attend_qkv covers this layer's head size
        self._one_op = hd % 64 == 0

    def forward(self, x: torch.Tensor, batch: FlatBatch, cache: KVCache) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; writes this layer's new K/V into the cache."""
        T = x.shape[0]
        # q/k/v fused into one low-bit call: rotary, cache writes and attention in one op
        qkv = joint_output((self.q, self.k, self.v), x) if self._one_op else None
        norms = self._norm_weights()
        if qkv is not None and norms is not None and (kernels := kernels_for(qkv)) is not None:
            o = kernels.attend_qkv(
                qkv,
                *self.cache_args(batch, cache, x.dtype),
                self.num_heads,
                self.scale,
                self.window or 0,
                *norms,
            )
            return self.o(o.reshape(T, -1))
        q = self.q(x).view(T, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        cos, sin = self.rope.cos_sin(batch.positions, x.dtype, batch.end)
        q = apply_rotary(q, cos, sin)
        self.store_kv(x, batch, cache)
        kc, vc = cache.k[self.layer], cache.v[self.layer]
        o = cached_attention(q, kc, vc, batch, self.scale, self.window, self.per_row)
        return self.o(o.reshape(T, -1))

    def store_kv(self, x: torch.Tensor, batch: FlatBatch, cache: KVCache) -> None:
        """Write the K/V of x's rows [T, hidden] into the cache (all the modules' `forward`
        writes): for rows whose attention output nobody reads, this is all a row needs."""
        T = x.shape[0]
        k = self.k(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v(x).view(T, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = self.rope.cos_sin(batch.positions, x.dtype, batch.end)
        cache.write(self.layer, batch, apply_rotary(k, cos, sin), v)

    def cache_args(self, batch: FlatBatch, cache: KVCache, dtype: torch.dtype) -> tuple:
        """What attend_qkv (and the kernels' DenseBlock) take after the layer's input: this
        layer's K/V cache, the rotary tables, and where the batch's rows go."""
        cos, sin = self.rope.cos_sin(batch.positions, dtype, batch.end)
        k, v = cache.k[self.layer], cache.v[self.layer]
        return k, v, cos, sin, batch.slots, batch.starts, batch.cu_seqlens, batch.positions

    def _norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float] | None:
        """attend_qkv's q/k norm arguments (None, None when the model has none); None when
        the norms are not float32 (the kernel's only dtype)."""
        if self.q_norm is None or self.k_norm is None:
            return None, None, 0.0
        q, k = self.q_norm.weight, self.k_norm.weight
        if q.dtype != torch.float32 or k.dtype != torch.float32:
            return None
        return q, k, self.q_norm.eps
