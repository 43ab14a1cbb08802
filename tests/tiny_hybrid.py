"""Tiny random Qwen3-Next / Qwen3.5 models, written as HF folders (with MTP weights added
the way the real checkpoints carry them: `mtp.*` tensors that transformers ignores)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import VOCAB

HYBRID_ARCHS = ("qwen3_next", "qwen3_5")
LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def hybrid_hf_config(arch: str, **overrides):  # noqa: ANN003, ANN201 (a transformers config)
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=1024,
        rms_norm_eps=2.0**-20,
        tie_word_embeddings=False,
        layer_types=LAYERS,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**{**common, **overrides})
    if arch == "qwen3_next":
        moe = dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[2],  # one dense MLP layer, as the config allows
        )
        return Qwen3NextConfig(**{**common, **moe, **overrides})
    raise ValueError(arch)


def _randomize(name: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Weights in ranges like trained ones: (1 + w) norms near 1, decays A in [0.5, 8]."""
    rand = torch.rand(p.shape, generator=g, dtype=torch.float64)
    if name.endswith("linear_attn.norm.weight"):
        return rand * 0.5 + 0.75  # the gated norm multiplies by w itself
    if name.endswith("norm.weight"):
        # w of a (1 + w) norm, on a 2^-16 grid: 1 + w is exact in float32, so folding the
        # 1 in before or after rounding to float32 gives the same weight
        return torch.round((rand * 0.5 - 0.25) * 2.0**16) / 2.0**16
    if name.endswith("A_log"):
        # log of float32 numbers, so llama.cpp's -exp(A_log) in GGUF round-trips exactly
        return (rand * 7.5 + 0.5).float().double().log()
    if name.endswith("conv1d.weight"):
        return torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3
    return torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.08


def make_hybrid_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:  # noqa: ANN003
    """A float64 transformers model with random weights."""
    from transformers import AutoModelForCausalLM

    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = AutoModelForCausalLM.from_config(
            hybrid_hf_config(arch, **overrides), attn_implementation="sdpa"
        )
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_randomize(name, p, g))
    return model.eval()


def mtp_tensors(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors as Qwen3-Next / Qwen3.5 checkpoints name them: fc, the two
    pre-fc norms, one full-attention decoder layer and the final norm."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    full = cfg.layer_types.index("full_attention")
    out = {}
    for name, p in model.model.layers[full].state_dict().items():
        out[f"mtp.layers.0.{name}"] = _randomize(name, p, g)
    hidden = cfg.hidden_size
    out["mtp.fc.weight"] = _randomize("fc.weight", torch.empty(hidden, 2 * hidden), g)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = _randomize("norm.weight", torch.empty(hidden), g)
    return out


def write_hybrid_folder(
    arch: str, folder: Path, seed: int = 0, mtp: bool = True, **overrides
) -> torch.nn.Module:  # noqa: ANN003
    """save_pretrained, then add the MTP tensors to the safetensors file."""
    from safetensors.torch import load_file, save_file

    model = make_hybrid_model(arch, seed, **overrides)
    model.save_pretrained(str(folder))
    if mtp:
        path = folder / "model.safetensors"
        tensors = {**load_file(str(path)), **mtp_tensors(model, seed + 1)}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), {"format": "pt"})
    return model
