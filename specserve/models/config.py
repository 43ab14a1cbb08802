"""ModelConfig: one description of every dense transformer we run (llama, qwen2, qwen3, gemma3).

Loaders (GGUF metadata, HF config.json) turn their own keys into this; the model code reads
nothing else. Differences between families are fields, never `if arch == ...` in the layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from specserve.errors import SpecserveError

DENSE_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


@dataclass
class ModelConfig:
    # the architectures this config class describes (subclasses describe others)
    ARCHS: ClassVar[tuple[str, ...]] = DENSE_ARCHS

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope base for sliding-window layers (gemma3 uses 10k locally, 1M globally)
    rope_theta_local: float | None = None
    # linear position scaling of global layers (gemma3 >= 1B); 1.0 = none
    rope_scale: float = 1.0
    attention_bias: bool = False
    qk_norm: bool = False
    # gemma's extra norms after attention and after the MLP, before the residual add
    sandwich_norm: bool = False
    activation: str = "silu"  # "silu" | "gelu_tanh"
    embed_scale: float = 1.0
    # softmax scale is query_scale (default 1/sqrt(head_dim))
    query_scale: float | None = None
    sliding_window: int | None = None
    # per layer: True where the layer attends to a sliding window only
    sliding_layers: list[bool] = field(default_factory=list)
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.arch not in self.ARCHS:
            raise SpecserveError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(self.ARCHS)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise SpecserveError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.activation not in ("silu", "gelu_tanh"):
            raise SpecserveError(f"unsupported activation {self.activation!r}")
        if not self.sliding_layers:
            self.sliding_layers = [False] * self.num_layers
        if len(self.sliding_layers) != self.num_layers:
            raise SpecserveError("sliding_layers must have one entry per layer")
        if any(self.sliding_layers) and not self.sliding_window:
            raise SpecserveError("sliding layers need a sliding_window size")
        if self.query_scale is None:
            self.query_scale = self.head_dim**-0.5

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.sliding_layers[layer] else None

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """(theta, position scale) for a layer: sliding layers use the local base, unscaled."""
        if self.sliding_layers[layer] and self.rope_theta_local is not None:
            return self.rope_theta_local, 1.0
        return self.rope_theta, self.rope_scale


HYBRID_ARCHS = ("qwen3_next", "qwen3_5")
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class HybridConfig(ModelConfig):
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers mixed with gated full attention.

    One description for both: Qwen3-Next's MoE + shared expert and Qwen3.5's dense MLP are
    `num_experts` (0 = dense MLP everywhere) and `moe_layers`. Attention layers have a
    sigmoid output gate, q/k norms and rotary embedding on the first `rotary_dim` dims only.
    """

    ARCHS: ClassVar[tuple[str, ...]] = HYBRID_ARCHS

    # per layer: "linear_attention" (Gated DeltaNet) or "full_attention"
    layer_types: list[str] = field(default_factory=list)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    conv_kernel: int = 4
    rotary_dim: int = 0  # 0 = head_dim // 4 (both families' partial_rotary_factor)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # per layer: True where the MLP is the sparse MoE block (empty = every layer when experts)
    moe_layers: list[bool] = field(default_factory=list)
    mtp_layers: int = 0  # multi-token-prediction layers shipped with the weights

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_layers
        if not self.layer_types:
            self.layer_types = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(n)]
        if len(self.layer_types) != n or set(self.layer_types) - {LINEAR, FULL}:
            raise SpecserveError(f"layer_types needs {n} entries of {LINEAR!r} / {FULL!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise SpecserveError("linear value heads must be a multiple of linear key heads")
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim // 4
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise SpecserveError(f"rotary_dim {self.rotary_dim} must be even and <= head_dim")
        if not self.moe_layers:
            self.moe_layers = [self.num_experts > 0] * n
        if len(self.moe_layers) != n:
            raise SpecserveError("moe_layers must have one entry per layer")
        if any(self.moe_layers) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise SpecserveError("MoE layers need 0 < experts per token <= experts")

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: q, k and v of all heads, concatenated."""
        return 2 * self.key_dim + self.value_dim

    def attention_layers(self) -> list[int]:
        """Indices of the full-attention layers; the i-th of them owns KV cache layer i."""
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    def linear_layers(self) -> list[int]:
        """Indices of the Gated DeltaNet layers; the i-th of them owns recurrent state i."""
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]
