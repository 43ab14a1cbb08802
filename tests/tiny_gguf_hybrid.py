"""Write a tiny Qwen3-Next / Qwen3.5 as GGUF the way llama.cpp's convert_hf_to_gguf.py
does (Qwen3NextModel / Qwen3_5TextModel): norms + 1, A stored as -exp(A_log), the conv
squeezed, Qwen3-Next's in_proj_qkvz re-laid as attn_qkv + attn_gate, Qwen3.5's value heads
in tiled order, experts stacked, MTP layers appended as extra blocks (Qwen3.5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_MTP = {"fc": "nextn.eh_proj", "pre_fc_norm_embedding": "nextn.enorm"}
_MTP |= {"pre_fc_norm_hidden": "nextn.hnorm", "norm": "nextn.shared_head_norm"}


def _tiled(t: torch.Tensor, dim: int, nk: int, r: int, head: int) -> torch.Tensor:
    """llama.cpp's _reorder_v_heads: value heads grouped by key head -> tiled order."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nk, r, head, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _reorder_v(name: str, t: torch.Tensor, cfg) -> torch.Tensor:  # noqa: ANN001
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    r, v = nv // nk, cfg.linear_value_head_dim
    key = cfg.linear_key_head_dim * nk * 2
    if "in_proj_qkv." in name or "conv1d" in name:
        return torch.cat((t[:key], _tiled(t[key:], 0, nk, r, v)))
    if "in_proj_z." in name:
        return _tiled(t, 0, nk, r, v)
    if "in_proj_b." in name or "in_proj_a." in name or "A_log" in name or "dt_bias" in name:
        return _tiled(t, 0, nk, r, 1)
    if "out_proj." in name:
        return _tiled(t, 1, nk, r, v)
    return t


def _split_qkvz(t: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """convert_hf_to_gguf's in_proj_qkvz -> (qkv, z) for Qwen3-Next."""
    nk, kd = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    rv = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim
    q, k, v, z = t.reshape(nk, 2 * kd + 2 * rv, -1).split([kd, kd, rv, rv], dim=1)
    flat = [x.reshape(-1, t.shape[-1]) for x in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def _block(rest: str, t: torch.Tensor, cfg, qwen35: bool) -> list[tuple[str, torch.Tensor]]:  # noqa: ANN001
    if qwen35 and cfg.linear_num_key_heads != cfg.linear_num_value_heads and "linear_attn" in rest:
        t = _reorder_v(rest, t, cfg)
    if rest.endswith("A_log"):
        t = -torch.exp(t)
    elif "conv1d" in rest:
        t = t.squeeze(1)
    elif rest.endswith("norm.weight") and not rest.endswith("linear_attn.norm.weight"):
        t = t + 1
    if rest == "linear_attn.in_proj_qkvz.weight":
        qkv, z = _split_qkvz(t, cfg)
        return [("attn_qkv.weight", qkv), ("attn_gate.weight", z)]
    return [(_BLOCK[rest], t)]


def _stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Experts as llama.cpp's converter sees them: transformers' fused gate_up_proj
    [E, 2I, D] split in two, per-expert tensors (checkpoints) stacked -> *.mlp.experts.X."""
    out, experts = {}, {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            head = name.removesuffix(".gate_up_proj")
            out[f"{head}.gate"], out[f"{head}.up"] = t.chunk(2, dim=1)
        elif name.endswith("mlp.experts.down_proj"):
            out[name.removesuffix("_proj")] = t
        elif ".mlp.experts." in name:
            head, rest = name.split(".mlp.experts.")
            e, kind = rest.split(".")[:2]
            experts.setdefault((head, kind.removesuffix("_proj")), {})[int(e)] = t
        else:
            out[name] = t
    for (head, kind), ts in experts.items():
        out[f"{head}.mlp.experts.{kind}"] = torch.stack([ts[e] for e in sorted(ts)])
    return out


def write_hybrid_gguf(
    hf_model: torch.nn.Module,
    arch: str,
    path: Path,
    mtp: dict[str, torch.Tensor] | None = None,
    tables: dict[str, str] | None = None,
) -> Path:
    """tables: GGUF tensor name -> type for tensors written as quantized blocks
    (tests/tiny_gguf.py gguf_blocks); the others are float32."""
    import gguf

    from tests.tiny_gguf import gguf_blocks

    cfg = hf_model.config
    qwen35 = arch == "qwen3_5"
    n = cfg.num_hidden_layers
    n_mtp = 1 if (mtp and qwen35) else 0  # llama.cpp keeps MTP layers for Qwen3.5 only
    g = "qwen35" if qwen35 else "qwen3next"
    w = gguf.GGUFWriter(str(path), g)
    w.add_block_count(n + n_mtp)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(cfg.head_dim * rope["partial_rotary_factor"]))
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(cfg.layer_types.index("full_attention") + 1)
    if not qwen35:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if n_mtp:
        w.add_uint32(f"{g}.nextn_predict_layers", n_mtp)
    state = _stack_experts({**hf_model.state_dict(), **(mtp if mtp and n_mtp else {})})
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp's converter writes no output.weight
        for gname, a in _names(name, t.detach().double(), cfg, qwen35, n):
            floats = np.ascontiguousarray(a.to(torch.float32).numpy())
            if tables and gname in tables:
                qtype = gguf.GGMLQuantizationType[tables[gname]]
                w.add_tensor(gname, gguf_blocks(floats, tables[gname]), raw_dtype=qtype)
                continue
            w.add_tensor(gname, floats)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _names(name: str, t: torch.Tensor, cfg, qwen35: bool, n: int) -> list[tuple[str, torch.Tensor]]:  # noqa: ANN001
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return [(top[name], t)]
    if name == "model.norm.weight":
        return [("output_norm.weight", t + 1)]
    if name.startswith("mtp.") and not name.startswith("mtp.layers."):
        stem = name.removeprefix("mtp.").removesuffix(".weight")
        return [(f"blk.{n}.{_MTP[stem]}.weight", t if stem == "fc" else t + 1)]
    if ".mlp.experts." in name:
        head, kind = name.split(".mlp.experts.")
        layer = int(head.split(".")[-1]) + (n if name.startswith("mtp.") else 0)
        return [(f"blk.{layer}.ffn_{kind}_exps.weight", t)]
    parts = name.split(".", 3)  # model.layers.i.rest / mtp.layers.j.rest
    layer = int(parts[2]) + (n if parts[0] == "mtp" else 0)
    return [(f"blk.{layer}.{g}", a) for g, a in _block(parts[3], t, cfg, qwen35)]
