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


# Qwen3-Next / Qwen3.5 (HybridTransformer). Our names, per block layers.{i}.:
#   attn_norm, ffn_norm; gdn.{qkv,z,b,a,out}.weight, gdn.conv [C, W], gdn.dt_bias,
#   gdn.A_log, gdn.norm.weight; attn.{q,k,v,o}.weight, attn.{q,k}_norm.weight;
#   ffn.{gate,up,down}.weight (dense) or ffn.router.weight, ffn.{gate,up,down}_exps,
#   ffn.shared.{gate,up,down}.weight, ffn.shared_gate.weight (MoE);
# and the MTP head: mtp.{fc,embed_norm,hidden_norm,norm}.weight, mtp.layers.{j}.<block>.
HYBRID_HF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "gdn.qkv.weight",  # Qwen3.5's separate projections
    "linear_attn.in_proj_z.weight": "gdn.z.weight",
    "linear_attn.in_proj_b.weight": "gdn.b.weight",
    "linear_attn.in_proj_a.weight": "gdn.a.weight",
    "linear_attn.conv1d.weight": "gdn.conv",  # [C, 1, W] -> [C, W]
    "linear_attn.dt_bias": "gdn.dt_bias",
    "linear_attn.A_log": "gdn.A_log",
    "linear_attn.norm.weight": "gdn.norm.weight",
    "linear_attn.out_proj.weight": "gdn.out.weight",
    "mlp.gate_proj.weight": "ffn.gate.weight",
    "mlp.up_proj.weight": "ffn.up.weight",
    "mlp.down_proj.weight": "ffn.down.weight",
    "mlp.gate.weight": "ffn.router.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn.shared.gate.weight",
    "mlp.shared_expert.up_proj.weight": "ffn.shared.up.weight",
    "mlp.shared_expert.down_proj.weight": "ffn.shared.down.weight",
    "mlp.shared_expert_gate.weight": "ffn.shared_gate.weight",
    "mlp.experts.gate_up_proj": "ffn.gate_up_exps",  # transformers' fused [E, 2I, D]: split
    "mlp.experts.down_proj": "ffn.down_exps",
}
HYBRID_HF_MTP = {
    "mtp.fc.weight": "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight": "mtp.embed_norm.weight",
    "mtp.pre_fc_norm_hidden.weight": "mtp.hidden_norm.weight",
    "mtp.norm.weight": "mtp.norm.weight",
}
# llama.cpp's names (convert_hf_to_gguf.py, Qwen3NextModel / Qwen3_5TextModel)
HYBRID_GGUF_BLOCK = {
    "attn_norm.weight": "attn_norm.weight",
    "post_attention_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "attn.q.weight",
    "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight",
    "attn_output.weight": "attn.o.weight",
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "attn_qkv.weight": "gdn.qkv.weight",
    "attn_gate.weight": "gdn.z.weight",
    "ssm_beta.weight": "gdn.b.weight",  # qwen35
    "ssm_alpha.weight": "gdn.a.weight",  # qwen35
    "ssm_ba.weight": "gdn.ba",  # qwen3next: in_proj_ba as is, split on load
    "ssm_in.weight": "gdn.qkvz",  # legacy qwen3next: in_proj_qkvz as is, split on load
    "ssm_conv1d.weight": "gdn.conv",
    "ssm_dt.bias": "gdn.dt_bias",
    "ssm_a": "gdn.A_log",  # stored as A = -exp(A_log)
    "ssm_norm.weight": "gdn.norm.weight",
    "ssm_out.weight": "gdn.out.weight",
    "ffn_gate.weight": "ffn.gate.weight",
    "ffn_up.weight": "ffn.up.weight",
    "ffn_down.weight": "ffn.down.weight",
    "ffn_gate_inp.weight": "ffn.router.weight",
    "ffn_gate_exps.weight": "ffn.gate_exps",
    "ffn_up_exps.weight": "ffn.up_exps",
    "ffn_down_exps.weight": "ffn.down_exps",
    "ffn_gate_up_exps.weight": "ffn.gate_up_exps",
    "ffn_gate_shexp.weight": "ffn.shared.gate.weight",
    "ffn_up_shexp.weight": "ffn.shared.up.weight",
    "ffn_down_shexp.weight": "ffn.shared.down.weight",
    "ffn_gate_inp_shexp.weight": "ffn.shared_gate.weight",
    # MTP blocks (llama.cpp appends them after the main layers, as "nextn")
    "nextn.eh_proj.weight": "fc.weight",
    "nextn.enorm.weight": "embed_norm.weight",
    "nextn.hnorm.weight": "hidden_norm.weight",
    "nextn.shared_head_norm.weight": "norm.weight",
}


def keeps_precision(ours: str) -> bool:
    """Small tensors kept in float32 under 16-bit dtypes: norms and the GDN decay terms."""
    return is_norm(ours) or ours.endswith((".A_log", ".dt_bias"))
