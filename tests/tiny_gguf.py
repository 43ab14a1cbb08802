"""Write a tiny HF model as GGUF in llama.cpp's layout (as its convert_hf_to_gguf.py would)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _gguf_name(hf_name: str, gemma: bool) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, kind = hf_name.rsplit(".", 1)
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    if part == "post_attention_layernorm":
        return f"blk.{layer}.{'post_attention_norm' if gemma else 'ffn_norm'}.{kind}"
    return f"blk.{layer}.{_BLOCK[part]}.{kind}"


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: interleave each head's rope halves (llama q/k only)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_blocks(a: np.ndarray, qtype: str, seed: int = 0) -> np.ndarray:
    """float32 [rows, cols] -> GGUF blocks of type qtype (uint8 [rows, bytes per row]).

    The gguf package quantizes Q8_0, Q5_0, Q4_0, ...; it has no quantizer for the K types,
    so Q4_K / Q6_K get random blocks with finite half-precision scales (their values do not
    follow `a`; what the tests need is a valid table in that format)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    rows, cols = a.shape
    if qtype not in ("Q4_K", "Q6_K"):
        return gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    # Q4_K: d, dmin (f16) lead the block; Q6_K: d (f16) ends it
    at = [0, 2] if qtype == "Q4_K" else [size - 2]
    for i in at:
        scale = rng.uniform(1e-5, 2e-4, blocks.shape[0]).astype(np.float16)
        blocks[:, i : i + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_gguf(
    hf_model: torch.nn.Module, arch: str, path: Path, tables: dict[str, str] | None = None
) -> Path:
    """tables: GGUF tensor name -> type for tensors written as quantized blocks
    ({"token_embd.weight": "Q8_0"}; gguf_blocks) or as "F16"; the others are float32."""
    import gguf

    cfg = hf_model.config
    gemma = arch == "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base((rope["full_attention"] if gemma else rope)["rope_theta"])
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
    for name, t in hf_model.state_dict().items():
        a = t.detach().to(torch.float32).numpy()
        if gemma and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp stores gemma's (1 + w) norm weights with the 1 added
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            a = _permute(a, heads)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp's converter writes no output.weight
        gname = _gguf_name(name, gemma)
        if tables and tables.get(gname) == "F16":
            w.add_tensor(gname, a.astype(np.float16))
            continue
        if tables and gname in tables:
            qtype = gguf.GGMLQuantizationType[tables[gname]]
            w.add_tensor(gname, gguf_blocks(a, tables[gname]), raw_dtype=qtype)
            continue
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
