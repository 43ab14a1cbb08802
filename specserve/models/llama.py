"""The dense transformer family (llama, qwen2, qwen3, gemma3) from one config-driven model."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from specserve.batch import FlatBatch
from specserve.cache.kv import KVCache
from specserve.models.config import ModelConfig
from specserve.models.layers.attention import Attention
from specserve.models.layers.basic import GatedMLP, RMSNorm, RotaryEmbedding, add_norm
from specserve.models.layers.block_kernel import KernelBlockModule
from specserve.models.layers.embedding import Embedding, rows_dtype_device
from specserve.models.layers.lowbit import linear_into
from specserve.models.layers.taps import Taps


class Block(KernelBlockModule):
    # the whole block as one C++ call where every piece runs on our float32 CPU kernels
    # (models/layers/block_kernel.py: the same kernels, the same bits); False: the modules
    use_kernel = True

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.attn_norm = RMSNorm(cfg.hidden_size, eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation)
        # gemma: norms on the branch outputs too ("sandwich"); identity elsewhere
        sandwich = cfg.sandwich_norm
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps) if sandwich else None
        self.post_ffn_norm = RMSNorm(cfg.hidden_size, eps) if sandwich else None

    def kernel_parts(self) -> tuple[Attention, GatedMLP, list[RMSNorm | None]]:
        norms = [self.attn_norm, self.ffn_norm, self.post_attn_norm, self.post_ffn_norm]
        return self.attn, self.mlp, norms

    def forward(
        self, x: torch.Tensor, h: torch.Tensor | None, batch: FlatBatch, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; h: the previous block's output, not yet added to x (None
        in the first block). Returns (x, this block's output): each residual add is left to
        the norm after it, so the two run as one op (`add_norm`)."""
        kernel = self.kernel_for(x)
        if kernel is not None:
            x, out = kernel.forward(x, h, *self.attn.cache_args(batch, cache, x.dtype))
            return x, out
        x, normed = (x, self.attn_norm(x)) if h is None else add_norm(x, h, self.attn_norm)
        a = self.attn(normed, batch, cache)
        x, normed = add_norm(
            x, a if self.post_attn_norm is None else self.post_attn_norm(a), self.ffn_norm
        )
        m = self.mlp(normed)
        return x, m if self.post_ffn_norm is None else self.post_ffn_norm(m)


class DenseTransformer(nn.Module):
    """forward(tokens [T], batch) -> hidden [T, hidden]; logits(hidden [N, hidden]) -> [N, V]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # a QuantizedEmbedding when a GGUF's table is block-quantized (loading/model.py)
        self.embed: Embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
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
        if not isinstance(self.embed, nn.Embedding):
            raise TypeError("a quantized embedding has no float table to tie the LM head to")
        self.lm_head.weight = self.embed.weight

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        dtype, device = rows_dtype_device(self.embed)
        cfg = self.cfg
        return KVCache(
            cfg.num_layers, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim, dtype, device
        )

    def forward(
        self, tokens: torch.Tensor, batch: FlatBatch, cache: KVCache, taps: Taps | None = None
    ) -> torch.Tensor:
        """The final normed hidden states [T, D]; with `taps`, the tapped layers' inputs
        written into them as the forward passes (models/layers/taps.py)."""
        cache.check_room(batch)
        x = self.embed(tokens)
        if self.cfg.embed_scale != 1.0:
            # the scale is rounded to the activation dtype first, as transformers does
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        h = None
        for i, block in enumerate(self.layers):
            if taps is not None:
                taps.take(i, x, h)
            x, h = block(x, h, batch, cache)
        cache.advance(batch)
        return self.norm(x) if h is None else add_norm(x, h, self.norm)[1]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, D] -> [N, V]; into `out` where the LM head can (models/registry.py)."""
        logits = linear_into(self.lm_head, hidden, out)
        cap = self.cfg.final_logit_softcap
        if cap:  # in place: the logits are this call's own (or the caller's buffer)
            logits.div_(cap).tanh_().mul_(cap)
        return logits
