"""EAGLE-3 draft head: one llama decoder layer that reads three of the target's layers.

From the residual streams of three target layers (low, middle, high) at position i, fused
by `fc` (3 * H_target -> H), and the embedding of token x_{i+1}, it predicts x_{i+2}:

    g    = fc(concat(h_low, h_mid, h_high))         # or the head's own `prenorm` when drafting
    a    = attn(concat(embed_norm(e), hidden_norm(g)))  # q/k/v read 2H, as in EAGLE-3
    x    = g + a;  x = x + mlp(ffn_norm(x))         # prenorm: fed back for the next draft step
    out  = lm_head(norm(x))                         # over a reduced draft vocabulary

Draft id j is target id `d2t[j]` (held here as absolute ids; the HF layouts store the
offset d2t[j] - j, llama.cpp's GGUF the absolute id). The tapped layer ids follow vLLM's
`eagle_aux_hidden_state_layer_ids`: id j is the input of target layer j (0 = the embedding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specserve.batch import FlatBatch
from specserve.cache.kv import KVCache
from specserve.models.config import ModelConfig
from specserve.models.layers.attention import Attention, store_before_last
from specserve.models.layers.basic import GatedMLP, RMSNorm
from specserve.models.layers.block_kernel import KernelBlockModule


@dataclass(frozen=True)
class Eagle3Config:
    """The head's decoder layer (`layer`: a one-layer llama config whose vocab_size is the
    target's) and what ties it to its target."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # the target layers tapped (vLLM's ids)
    norm_before_residual: bool = False  # the residual is hidden_norm(g) (RedHat's heads)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size


@dataclass(frozen=True)
class HeadCalibration:
    """How often a head's greedy drafts were kept on held-out text (`specserve train-head`
    counts it; saved beside the head): the first token per class of the head's probability
    for it (the classes split at `bounds`), and each later one that passed `p_min`, given
    the draft reached it. What a serving engine may expect of the head before it has
    verified any of its drafts."""

    bounds: tuple[float, ...]
    first_kept: tuple[int, ...]  # per class, len(bounds) + 1
    first_rows: tuple[int, ...]
    p_min: float
    later_kept: int
    later_rows: int

    @classmethod
    def empty(cls, bounds: tuple[float, ...], p_min: float) -> HeadCalibration:
        """No rows counted yet: what counts of these classes and p_min add up from."""
        zeros = (0,) * (len(bounds) + 1)
        return cls(bounds, zeros, zeros, p_min, 0, 0)

    def __add__(self, other: HeadCalibration) -> HeadCalibration:
        if (self.bounds, self.p_min) != (other.bounds, other.p_min):
            raise ValueError("only counts of the same classes and p_min add up")
        return HeadCalibration(
            self.bounds,
            tuple(a + b for a, b in zip(self.first_kept, other.first_kept, strict=True)),
            tuple(a + b for a, b in zip(self.first_rows, other.first_rows, strict=True)),
            self.p_min,
            self.later_kept + other.later_kept,
            self.later_rows + other.later_rows,
        )


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and llama.cpp's choice when a checkpoint names none (SpecForge's 1, N/2 - 1,
    N - 4 counted as layer outputs)."""
    return (min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))


def taps_fit(layers: tuple[int, ...], num_layers: int) -> bool:
    """Whether `layers` are three layer ids a target of `num_layers` layers can tap."""
    return len(layers) == 3 and all(0 <= i < num_layers for i in layers)


class Eagle3Head(KernelBlockModule):
    # the cached step's layer, its norms included, as one C++ call where the head runs on our
    # float32 CPU kernels (DenseBlock.eagle_step: the same kernels, the same bits); a draft
    # step is small, and the modules' Python calls around its kernels were a large share of
    # it (docs/perf/2026-11-29-head-kernel.md). False: the modules
    use_kernel = True

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, eps, lc = cfg.hidden_size, cfg.layer.rms_norm_eps, cfg.layer
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, h, bias=False)
        self.embed_norm = RMSNorm(h, eps)  # input_layernorm
        self.hidden_norm = RMSNorm(h, eps)
        self.attn = Attention(lc, 0)
        hd = lc.head_dim  # q/k/v read [embedding, fused state]: 2H wide
        self.attn.q = nn.Linear(2 * h, lc.num_heads * hd, bias=lc.attention_bias)
        self.attn.k = nn.Linear(2 * h, lc.num_kv_heads * hd, bias=lc.attention_bias)
        self.attn.v = nn.Linear(2 * h, lc.num_kv_heads * hd, bias=lc.attention_bias)
        self.ffn_norm = RMSNorm(h, eps)  # post_attention_layernorm
        self.mlp = GatedMLP(h, lc.intermediate_size, lc.activation)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        # draft id -> target id (absolute); identity while the draft vocabulary is the target's
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size))
        self.embed: nn.Embedding | None = None  # the head's own table, if its weights have one
        self.calibration: HeadCalibration | None = None  # measured on held-out text, if saved

    def kernel_parts(self) -> tuple[Attention, GatedMLP, list[RMSNorm | None]]:
        # q/k/v read two inputs normed apart (`_inputs`): the block's first norm goes unused
        return self.attn, self.mlp, [self.embed_norm, self.ffn_norm, None, None]

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """dtype: the activations' (default: the norms', which quantized linears leave float,
        but which stay float32 under 16-bit activations)."""
        p, lc = self.norm.weight, self.cfg.layer
        dtype = dtype or p.dtype
        return KVCache(1, num_slots, max_len, lc.num_kv_heads, lc.head_dim, dtype, p.device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's tapped states [T, 3 * H_target] -> the head's input state [T, H]."""
        return self.fc(aux)

    def layer(
        self,
        embeds: torch.Tensor,
        g: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, g [T, H] -> (normed [T, H] for the lm_head, prenorm [T, H] fed back).
        `attend(x) -> [T, H]` runs the attention (cached here, plain causal in training)."""
        x, residual = self._inputs(embeds, g)
        x = residual + attend(x)
        x = x + self.mlp(self.ffn_norm(x))
        return self.norm(x), x

    def _inputs(self, embeds: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what q/k/v read [T, 2H], the residual the attention's output is added to)."""
        normed_g = self.hidden_norm(g)
        x = torch.cat((self.embed_norm(embeds), normed_g), dim=-1)
        return x, normed_g if self.cfg.norm_before_residual else g

    def forward(
        self, embeds: torch.Tensor, g: torch.Tensor, batch: FlatBatch, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One cached step over flat rows (see `layer`)."""
        cache.check_room(batch)
        kernel = self.kernel_for(g)
        if kernel is not None and embeds.dtype == g.dtype:
            args = self.attn.cache_args(batch, cache, g.dtype)
            norms = self.hidden_norm.weight, self.norm.weight, self.cfg.norm_before_residual
            normed, x = kernel.eagle_step(embeds, g, *norms, *args)
            out = normed, x
        else:
            out = self.layer(embeds, g, lambda x: self.attn(x, batch, cache))
        cache.advance(batch)
        return out

    def forward_last(
        self, embeds: torch.Tensor, g: torch.Tensor, batch: FlatBatch, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s outputs for each sequence's last row only ([S, H] each). In one layer
        a row's K/V come from its own input alone, so the rows before each last one just
        store theirs (`Attention.store_kv`): attention, MLP and norms run for the last rows.
        A head not asked for a while catches up over every token since at the price of its
        K/V, not of its whole layer per token (docs/perf/2026-11-29-head-catch-up.md)."""

        def store(rows: list[int], before: FlatBatch) -> None:
            self.attn.store_kv(self._inputs(embeds[rows], g[rows])[0], before, cache)

        if batch.num_tokens == batch.num_seqs:  # a draft step: every row is a last one
            return self(embeds, g, batch, cache)
        last_batch, last = store_before_last(batch, cache, store), batch.last_rows()
        if last_batch is None:
            normed, prenorm = self(embeds, g, batch, cache)
            return normed[last], prenorm[last]
        return self(embeds[last], g[last], last_batch, cache)

    def target_logits(self, small: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits [N, Vd] -> over the target's vocabulary [N, V] (-inf
        outside the draft's)."""
        full = small.new_full((small.shape[0], vocab_size), float("-inf"))
        full[:, self.d2t] = small
        return full
