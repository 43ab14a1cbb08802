"""HF folders (config.json + *.safetensors) -> ModelConfig + tensors under our names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specserve.errors import SpecserveError
from specserve.loading import qwen3_next as hybrid
from specserve.loading.names import hf_to_ours, is_norm
from specserve.models.config import ModelConfig

# HF model_type -> our arch name
HF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def _rope(hf: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """transformers 5 keeps rope settings in `rope_parameters` (per layer type for gemma3);
    older configs have top-level `rope_theta` / `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    if layer_type in params:
        params = params[layer_type]
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(params) if params else dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise SpecserveError(f"unsupported rope scaling {kind!r}")
    return {
        "theta": float(theta),
        "scale": float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0,
    }


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    model_type = hf.get("model_type", "")
    if model_type == "gemma3":  # multimodal wrapper: the text model's config is nested
        hf = hf["text_config"]
        model_type = "gemma3_text"
    if model_type not in HF_ARCHS:
        raise SpecserveError(f"unsupported architecture {model_type!r} in config.json")
    arch = HF_ARCHS[model_type]
    n_layers = hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    layer_types = hf.get("layer_types") or ["full_attention"] * n_layers
    sliding = [t == "sliding_attention" for t in layer_types]
    gemma = arch == "gemma3"
    glob, local = _rope(hf, "full_attention"), _rope(hf, "sliding_attention")
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    return ModelConfig(
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        context_length=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=glob["theta"],
        rope_theta_local=local["theta"] if gemma else None,
        rope_scale=glob["scale"],
        # qwen2 always has q/k/v bias; llama has it when attention_bias is set
        attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "gemma3"),
        sandwich_norm=gemma,
        activation="gelu_tanh" if act.startswith("gelu") else "silu",
        embed_scale=hf["hidden_size"] ** 0.5 if gemma else 1.0,
        query_scale=hf["query_pre_attn_scalar"] ** -0.5 if gemma else None,
        sliding_window=hf.get("sliding_window") if any(sliding) else None,
        sliding_layers=sliding,
        final_logit_softcap=hf.get("final_logit_softcapping"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def read_hf(folder: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Config and a stream of (our name, float tensor) pairs from an HF folder (hybrid
    Qwen3-Next / Qwen3.5 folders go through loading/qwen3_next.py)."""
    from safetensors import safe_open

    hf = json.loads((folder / "config.json").read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpecserveError(f"{folder}: no *.safetensors files")
    if hf.get("model_type") in hybrid.HF_TYPES:
        return hybrid.read_hf(hf, files)
    cfg = config_from_hf(hf)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    ours = hf_to_ours(name, cfg.sandwich_norm)
                    if ours is None:
                        continue
                    t = st.get_tensor(name)
                    if cfg.arch == "gemma3" and is_norm(ours):
                        # gemma stores w for a (1 + w) norm; our RMSNorm multiplies by w
                        t = t.double() + 1.0
                    yield ours, t

    return cfg, tensors()
