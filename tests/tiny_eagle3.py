"""Tiny EAGLE-3 heads for tiny targets: random ones, and one built to foresee the target.

`foreseeing_head` drafts what a target nearly free of context would say next: its attention
sees only the current row (a window of one), passes the token's embedding through, and
reads it out with the target's own final norm and LM head. On a target whose next token
depends mostly on the current one (`nearly_bigram`, or a large embedding gain) its drafts
are often right and sometimes wrong, which is what the exactness tests need.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from specserve.loading.eagle3 import save_eagle3
from specserve.models.config import ModelConfig
from specserve.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers


def head_config(
    target_cfg: ModelConfig, draft_vocab: int, window: int | None = None, heads: int = 4
) -> Eagle3Config:
    h = target_cfg.hidden_size
    layer = ModelConfig(
        arch="llama",
        vocab_size=target_cfg.vocab_size,
        hidden_size=h,
        intermediate_size=96,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=h // heads,
        context_length=target_cfg.context_length,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=10000.0,
        sliding_window=window,
        sliding_layers=[window is not None],
    )
    return Eagle3Config(layer, draft_vocab, h, default_aux_layers(target_cfg.num_layers))


def draft_ids(vocab: int, draft_vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:draft_vocab].sort().values


def random_head(
    target_cfg: ModelConfig, draft_vocab: int = 96, seed: int = 0, heads: int = 4
) -> Eagle3Head:
    """Random float64 weights, norms near 1, a random reduced draft vocabulary."""
    torch.manual_seed(seed)
    head = Eagle3Head(head_config(target_cfg, draft_vocab, heads=heads)).double()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) * 0.5 + 0.75)
            else:
                p.normal_(0.0, 0.08)
        head.d2t.copy_(draft_ids(target_cfg.vocab_size, draft_vocab, seed))
    return head.eval()


def foreseeing_head(
    target: torch.nn.Module, draft_vocab: int = 112, noise: float = 0.0
) -> Eagle3Head:
    """A head whose logits are the target's LM head over its final norm of the embedding of
    the token it is fed (plus `noise` on its LM head)."""
    cfg = target.cfg
    h = cfg.hidden_size
    head = random_head(cfg, draft_vocab, seed=3)
    ids = head.d2t.clone()
    head = Eagle3Head(head_config(cfg, draft_vocab, window=1)).double()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.08, generator=g)
        head.fc.weight.zero_()  # the target's states are ignored: g = 0
        head.hidden_norm.weight.fill_(1.0)
        head.embed_norm.weight.fill_(1.0)
        head.attn.v.weight.copy_(torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1))
        head.attn.o.weight.copy_(torch.eye(h))
        head.ffn_norm.weight.fill_(1.0)
        head.mlp.down.weight.zero_()
        head.norm.weight.copy_(target.norm.weight)
        lm = target.lm_head.weight.detach().cpu()[ids]  # the head is made on the CPU
        head.lm_head.weight.copy_(
            lm + noise * lm.std() * torch.randn(lm.shape, generator=g, dtype=lm.dtype)
        )
        head.d2t.copy_(ids)
    return head.eval()


def nearly_bigram(
    target: torch.nn.Module, scale: float = 0.15, gain: float = 3.0
) -> torch.nn.Module:
    """The target with every block's output scaled down and its embedding up: its next
    token follows mostly, not always, from the current one."""
    model = copy.deepcopy(target)
    with torch.no_grad():
        model.embed.weight.mul_(gain)
        for block in model.layers:
            block.attn.o.weight.mul_(scale)
            block.mlp.down.weight.mul_(scale)
    return model


# ---- the public layouts, written as their makers write them -------------------------------
def write_vllm_layout(head: Eagle3Head, folder: Path, speculators: bool = False) -> Path:
    """vLLM / AngelSlim's `Eagle3LlamaForCausalLM` (the layer under `layers.0.`) or, with
    `speculators`, vLLM speculators' `Eagle3Speculator` (llama fields nested)."""
    from safetensors.torch import load_file, save_file

    save_eagle3(head, folder)  # SpecForge's, then renamed
    state = load_file(str(folder / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    save_file(renamed, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    aux = cfg.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
    cfg["eagle_aux_hidden_state_layer_ids"] = aux
    if speculators:
        layer_keys = ["hidden_size", "intermediate_size", "num_attention_heads", "head_dim"]
        layer_keys += ["num_key_value_heads", "rms_norm_eps", "rope_theta", "vocab_size"]
        nested = {k: cfg.pop(k) for k in layer_keys}
        cfg = {"architectures": ["Eagle3Speculator"], "transformer_layer_config": nested, **cfg}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


_GGUF = {"embed_norm": "attn_norm", "hidden_norm": "attn_norm_2", "attn.q": "attn_q",
         "attn.k": "attn_k", "attn.v": "attn_v", "attn.o": "attn_output",
         "ffn_norm": "ffn_norm", "mlp.gate": "ffn_gate", "mlp.up": "ffn_up",
         "mlp.down": "ffn_down"}  # fmt: skip
_GGUF_TOP = {"fc": "fc", "norm": "output_norm", "lm_head": "output", "embed": "token_embd"}


def write_gguf_head(head: Eagle3Head, path: Path) -> Path:
    """llama.cpp's `eagle3` GGUF, as its converter writes it (q/k rope-permuted, d2t as
    absolute int64 ids, the tapped layers and target size in the metadata)."""
    import gguf
    import numpy as np

    from tests.tiny_gguf import _permute

    cfg, lc = head.cfg, head.cfg.layer
    w = gguf.GGUFWriter(str(path), "eagle3")
    w.add_block_count(1)
    w.add_context_length(lc.context_length)
    w.add_embedding_length(lc.hidden_size)
    w.add_feed_forward_length(lc.intermediate_size)
    w.add_head_count(lc.num_heads)
    w.add_head_count_kv(lc.num_kv_heads)
    w.add_layer_norm_rms_eps(lc.rms_norm_eps)
    w.add_key_length(lc.head_dim)
    w.add_value_length(lc.head_dim)
    w.add_rope_freq_base(lc.rope_theta)
    w.add_array("eagle3.target_layers", list(cfg.aux_layers))
    w.add_uint32("eagle3.target_hidden_size", cfg.target_hidden_size)
    for name, t in head.state_dict().items():
        if name == "d2t":
            w.add_tensor("d2t", t.numpy().astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
            continue
        stem, _, kind = name.rpartition(".")
        a = t.detach().to(torch.float32).numpy()
        if stem in ("attn.q", "attn.k"):
            a = _permute(a, lc.num_heads if stem == "attn.q" else lc.num_kv_heads)
        gname = f"blk.0.{_GGUF[stem]}" if stem in _GGUF else _GGUF_TOP[stem]
        w.add_tensor(f"{gname}.{kind}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
