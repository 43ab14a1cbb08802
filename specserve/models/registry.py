"""Architectures by name: the model class that runs each, and how HF / GGUF name it.

    build(cfg)              -> an (empty) model for cfg.arch
    arch_from_hf(type)      -> our arch for an HF config.json `model_type`
    arch_from_gguf(name)    -> our arch for a GGUF `general.architecture`
    is_hybrid(arch)         -> whether its weights load through loading/qwen3_next.py

Every model class has the same surface: cfg, embed (nn.Embedding, or QuantizedEmbedding
for a GGUF's block-quantized table: layers/embedding.py), lm_head, new_cache(num_slots,
max_len) -> its cache, forward(tokens [T], FlatBatch, cache) -> hidden [T, D] and
logits(hidden [N, D], out=None) -> [N, V] (written into `out` where the LM head is a
low-bit kernel: the engine's reused buffer, engine/runner.py). The runner, the loaders and
the speculators never ask which one they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import SpecserveError
from specserve.models.config import HybridConfig, ModelConfig
from specserve.models.llama import DenseTransformer
from specserve.models.qwen3_next import HybridTransformer

LanguageModel = DenseTransformer | HybridTransformer


@dataclass(frozen=True)
class Architecture:
    model: type[DenseTransformer] | type[HybridTransformer]
    hf_types: tuple[str, ...]  # config.json model_type values
    gguf_names: tuple[str, ...]  # general.architecture values


_DENSE, _HYBRID = DenseTransformer, HybridTransformer
ARCHITECTURES = {
    "llama": Architecture(_DENSE, ("llama",), ("llama",)),
    "qwen2": Architecture(_DENSE, ("qwen2",), ("qwen2",)),
    "qwen3": Architecture(_DENSE, ("qwen3",), ("qwen3",)),
    "gemma3": Architecture(_DENSE, ("gemma3", "gemma3_text"), ("gemma3",)),
    "qwen3_next": Architecture(_HYBRID, ("qwen3_next",), ("qwen3next",)),
    "qwen3_5": Architecture(
        _HYBRID,
        ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        ("qwen35", "qwen35moe"),
    ),
}


def _lookup(names: dict[str, tuple[str, ...]], name: str) -> str:
    for arch, known in names.items():
        if name in known:
            return arch
    every = sorted(n for known in names.values() for n in known)
    raise SpecserveError(f"unsupported architecture {name!r}; supported: {', '.join(every)}")


def arch_from_hf(model_type: str) -> str:
    return _lookup({k: a.hf_types for k, a in ARCHITECTURES.items()}, model_type)


def arch_from_gguf(name: str) -> str:
    return _lookup({k: a.gguf_names for k, a in ARCHITECTURES.items()}, name)


def is_hybrid(arch: str) -> bool:
    """Whether the arch has recurrent (Gated DeltaNet) layers."""
    return ARCHITECTURES[arch].model is HybridTransformer


def build(cfg: ModelConfig) -> LanguageModel:
    """An empty model of cfg.arch (call under torch.device("meta") to skip allocation)."""
    if cfg.arch not in ARCHITECTURES:
        raise SpecserveError(f"unsupported architecture {cfg.arch!r}")
    if isinstance(cfg, HybridConfig):
        return HybridTransformer(cfg)
    return DenseTransformer(cfg)
