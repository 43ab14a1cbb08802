"""Tensor-name tables: GGUF (llama.cpp) and HF names -> specserve's own parameter names.

Our names (DenseTransformer.state_dict()):
    embed.weight, norm.weight, lm_head.weight,
    layers.{i}.attn_norm / ffn_norm / post_attn_norm / post_ffn_norm .weight,
    layers.{i}.attn.{q,k,v,o}.{weight,bias}, layers.{i}.attn.{q,k}_norm.weight,
    layers.{i}.mlp.{gate,up,down}.weight
"""

from __future__ import annotations

import re

GGUF_TOP = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_BLOCK = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.q",
    "attn_k": "attn.k",
    "attn_v": "attn.v",
    "attn_output": "attn.o",
    "attn_q_norm": "attn.q_norm",
    "attn_k_norm": "attn.k_norm",
    "post_attention_norm": "post_attn_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "mlp.gate",
    "ffn_up": "mlp.up",
    "ffn_down": "mlp.down",
    "post_ffw_norm": "post_ffn_norm",
}

HF_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
HF_BLOCK_COMMON = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn.q",
    "self_attn.k_proj": "attn.k",
    "self_attn.v_proj": "attn.v",
    "self_attn.o_proj": "attn.o",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "mlp.gate_proj": "mlp.gate",
    "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down",
}
# "post_attention_layernorm" is the pre-MLP norm in llama/qwen but a real post-attention
# norm in gemma (whose pre-MLP norm is "pre_feedforward_layernorm").
HF_BLOCK_PLAIN = {**HF_BLOCK_COMMON, "post_attention_layernorm": "ffn_norm"}
HF_BLOCK_SANDWICH = {
    **HF_BLOCK_COMMON,
    "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffn_norm",
}

_GGUF_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def gguf_to_ours(name: str) -> str | None:
    """GGUF tensor name -> ours, or None for tensors we do not use (e.g. rope_freqs)."""
    if name in GGUF_TOP:
        return GGUF_TOP[name]
    m = _GGUF_RE.match(name)
    if m and m.group(2) in GGUF_BLOCK:
        return f"layers.{m.group(1)}.{GGUF_BLOCK[m.group(2)]}.{m.group(3)}"
    return None


def hf_to_ours(name: str, sandwich_norm: bool) -> str | None:
    """HF parameter name -> ours, or None for names we do not use."""
    name = name.removeprefix("language_model.")
    if name in HF_TOP:
        return HF_TOP[name]
    m = _HF_RE.match(name)
    table = HF_BLOCK_SANDWICH if sandwich_norm else HF_BLOCK_PLAIN
    if m and m.group(2) in table:
        return f"layers.{m.group(1)}.{table[m.group(2)]}.{m.group(3)}"
    return None


def is_norm(ours: str) -> bool:
    return ours.endswith("norm.weight")
