"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers mixed with gated full attention.

One config-driven model for both: the layer pattern comes from `layer_types`, the MLP is
the sparse MoE with a shared expert where `moe_layers` says so (Qwen3-Next) and a dense
SwiGLU elsewhere (Qwen3.5). Norms are (1 + w) RMSNorms whose 1 the loaders fold into w.
The weights' multi-token-prediction layers (if any) load into `mtp`, which the `mtp`
speculator drives with its own KV cache.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from specserve.batch import FlatBatch
from specserve.cache.kv import KVCache
from specserve.cache.recurrent import HybridCache, RecurrentCache, RecurrentShape
from specserve.models.config import LINEAR, HybridConfig
from specserve.models.layers.attention import store_before_last
from specserve.models.layers.basic import GatedMLP, RMSNorm
from specserve.models.layers.embedding import Embedding, rows_dtype_device
from specserve.models.layers.gated_attention import GatedAttention
from specserve.models.layers.gated_delta import GatedDeltaNet
from specserve.models.layers.lowbit import linear_into
from specserve.models.layers.moe import SparseMoE
from specserve.models.layers.taps import Taps


class HybridBlock(nn.Module):
    """Pre-norm residual block: (Gated DeltaNet | gated attention), then (MoE | MLP)."""

    def __init__(self, cfg: HybridConfig, linear: bool, index: int, moe: bool) -> None:
        """index: the block's recurrent-state index (linear) or KV cache layer (attention)."""
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.attn_norm = RMSNorm(hidden, eps)
        self.gdn = GatedDeltaNet(cfg, index) if linear else None
        self.attn = None if linear else GatedAttention(cfg, index)
        self.ffn_norm = RMSNorm(hidden, eps)
        if moe:
            self.ffn: nn.Module = SparseMoE(
                hidden,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                cfg.shared_expert_intermediate_size,
            )
        else:
            self.ffn = GatedMLP(hidden, cfg.intermediate_size, cfg.activation)

    def forward(
        self,
        x: torch.Tensor,
        batch: FlatBatch,
        kv: KVCache,
        recurrent: RecurrentCache | None,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        h = self.attn_norm(x)
        if self.gdn is not None:
            assert recurrent is not None
            h = self.gdn(h, batch, recurrent)
        else:
            assert self.attn is not None
            h = self.attn(h, batch, kv)
        x = x + h
        return x + self.ffn(self.ffn_norm(x))


class MtpHead(nn.Module):
    """Multi-token prediction: from the embedding of token x_{i+1} and the target's (final
    normed) hidden state at position i, predict x_{i+2}.

        h = layers(fc([embed_norm(e), hidden_norm(hidden)]));  hidden_out = norm(h)

    `hidden_out` feeds both the shared lm_head and the next draft step. Only the first of
    the weights' MTP layers is used (Qwen3-Next and Qwen3.5 ship one).
    """

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.embed_norm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        moe = cfg.num_experts > 0
        self.layers = nn.ModuleList(
            HybridBlock(cfg, linear=False, index=i, moe=moe) for i in range(cfg.mtp_layers)
        )
        self.norm = RMSNorm(hidden, eps)
        self.cfg = cfg

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        p, cfg = self.fc.weight, self.cfg
        return KVCache(1, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim, p.dtype, p.device)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, batch: FlatBatch, cache: KVCache
    ) -> torch.Tensor:
        """embeds, hidden: [T, hidden] -> the head's normed hidden state [T, hidden]."""
        return self._layer(self._fused(embeds, hidden), batch, cache)

    def forward_last(
        self, embeds: torch.Tensor, hidden: torch.Tensor, batch: FlatBatch, cache: KVCache
    ) -> torch.Tensor:
        """`forward` for each sequence's last row only [S, hidden]: the rows before it store
        their K/V, as an EAGLE-3 head's do (models/eagle3.py `forward_last`)."""
        x = self._fused(embeds, hidden)
        block = cast(HybridBlock, self.layers[0])
        attn = block.attn
        assert attn is not None  # an MTP layer is full attention

        def store(rows: list[int], before: FlatBatch) -> None:
            attn.store_kv(block.attn_norm(x[rows]), before, cache)

        last_batch, last = store_before_last(batch, cache, store), batch.last_rows()
        if last_batch is None:
            return self._layer(x, batch, cache)[last]
        return self._layer(x[last], last_batch, cache)

    def _fused(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat((self.embed_norm(embeds), self.hidden_norm(hidden)), dim=-1))

    def _layer(self, x: torch.Tensor, batch: FlatBatch, cache: KVCache) -> torch.Tensor:
        cache.check_room(batch)
        x = self.layers[0](x, batch, cache, None)
        cache.advance(batch)
        return self.norm(x)


class HybridTransformer(nn.Module):
    """forward(tokens [T], batch, cache) -> final normed hidden [T, hidden];
    logits(hidden [N, hidden]) -> [N, V]."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # a QuantizedEmbedding when a GGUF's table is block-quantized (loading/model.py)
        self.embed: Embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        counts = {True: 0, False: 0}  # next recurrent index / next KV layer
        blocks = []
        for i, kind in enumerate(cfg.layer_types):
            linear = kind == LINEAR
            blocks.append(HybridBlock(cfg, linear, counts[linear], cfg.moe_layers[i]))
            counts[linear] += 1
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MtpHead(cfg) if cfg.mtp_layers else None

    def tie_weights(self) -> None:
        if not isinstance(self.embed, nn.Embedding):
            raise TypeError("a quantized embedding has no float table to tie the LM head to")
        self.lm_head.weight = self.embed.weight

    def recurrent_shape(self) -> RecurrentShape:
        cfg = self.cfg
        return RecurrentShape(
            num_layers=len(cfg.linear_layers()),
            conv_dim=cfg.conv_dim,
            conv_width=cfg.conv_kernel,
            num_heads=cfg.linear_num_value_heads,
            key_dim=cfg.linear_key_head_dim,
            value_dim=cfg.linear_value_head_dim,
        )

    def new_cache(self, num_slots: int, max_len: int) -> HybridCache:
        (dtype, device), cfg = rows_dtype_device(self.embed), self.cfg
        kv = KVCache(
            len(cfg.attention_layers()),
            num_slots,
            max_len,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype,
            device,
        )
        return HybridCache(kv, RecurrentCache(self.recurrent_shape(), num_slots, dtype, device))

    def forward(
        self, tokens: torch.Tensor, batch: FlatBatch, cache: HybridCache, taps: Taps | None = None
    ) -> torch.Tensor:
        """The final normed hidden states [T, D]; with `taps`, the tapped layers' inputs
        written into them as the forward passes (models/layers/taps.py)."""
        cache.check_room(batch)
        x = self.embed(tokens)
        for i, block in enumerate(self.layers):
            if taps is not None:
                taps.take(i, x, None)
            x = block(x, batch, cache.kv, cache.recurrent)
        cache.advance(batch)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, D] -> [N, V]; into `out` where the LM head can (models/registry.py)."""
        return linear_into(self.lm_head, hidden, out)
