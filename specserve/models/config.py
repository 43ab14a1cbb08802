"""ModelConfig: one description of every dense transformer we run (llama, qwen2, qwen3, gemma3).

Loaders (GGUF metadata, HF config.json) turn their own keys into this; the model code reads
nothing else. Differences between families are fields, never `if arch == ...` in the layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.errors import SpecserveError

DENSE_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


@dataclass
class ModelConfig:
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
        if self.arch not in DENSE_ARCHS:
            raise SpecserveError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(DENSE_ARCHS)}"
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
