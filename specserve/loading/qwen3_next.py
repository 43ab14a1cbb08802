"""Qwen3-Next / Qwen3.5 weights -> HybridConfig + tensors under our names (HF and GGUF).

HF folders come in two projection layouts: Qwen3-Next's interleaved `in_proj_qkvz` /
`in_proj_ba` (grouped per key head: [q, k, v, z] and [b, a] of each group) and Qwen3.5's
separate `in_proj_qkv / z / b / a`; both become our q|k|v, z, b, a. Experts come one file
entry per expert (checkpoints) or fused [E, 2I, D] (transformers' own save): both stack.
Norms are (1 + w): HF stores w (folded here), GGUF stores 1 + w already.

GGUF follows llama.cpp's convert_hf_to_gguf.py: A is stored as -exp(A_log), Qwen3.5
reorders value heads from grouped to tiled order (undone here), and the MTP layers are
extra blocks after the main ones (`nextn_predict_layers` of `block_count`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specserve.errors import SpecserveError
from specserve.loading.names import HYBRID_GGUF_BLOCK, HYBRID_HF_BLOCK, HYBRID_HF_MTP
from specserve.models.config import FULL, LINEAR, HybridConfig
from specserve.models.layers.embedding import QuantizedTable
from specserve.models.registry import ARCHITECTURES, is_hybrid

# HF model_type / GGUF general.architecture -> our arch, for the hybrid family
HF_TYPES = {t: k for k, a in ARCHITECTURES.items() if is_hybrid(k) for t in a.hf_types}
GGUF_ARCHS = {n: k for k, a in ARCHITECTURES.items() if is_hybrid(k) for n in a.gguf_names}

_HF_BLOCK_RE = re.compile(r"^(?:model\.layers\.(\d+)|mtp\.layers\.(\d+))\.(.+)$")
_HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")


def _pattern(n_layers: int, interval: int) -> list[str]:
    """Both families' default: every `interval`-th layer is full attention."""
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]


def config_from_hf(hf: dict[str, Any], tensor_names: set[str]) -> HybridConfig:
    """config.json (plain or with a nested text_config) + the tensor names -> HybridConfig."""
    hf = {**hf, **hf.get("text_config", {})}
    arch = HF_TYPES[hf["model_type"]]
    n_layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    rope = {**hf, **(hf.get("rope_parameters") or {})}
    if rope.get("rope_type", "default") != "default":
        raise SpecserveError(f"unsupported rope type {rope['rope_type']!r}")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    experts = hf.get("num_experts", 0) or 0
    dense_only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1) or 1
    mtp = {int(m.group(1)) for n in tensor_names if (m := _MTP_LAYER_RE.match(n))}
    interval = hf.get("full_attention_interval", 4)
    return HybridConfig(
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf.get("intermediate_size") or 0,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        context_length=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        layer_types=hf.get("layer_types") or _pattern(n_layers, interval),
        linear_num_key_heads=hf["linear_num_key_heads"],
        linear_num_value_heads=hf["linear_num_value_heads"],
        linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 0.25)),
        num_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", 0) or 0,
        moe_intermediate_size=hf.get("moe_intermediate_size", 0) or 0,
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_layers=[
            experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(n_layers)
        ],
        mtp_layers=len(mtp),
    )


def _hf_ours(name: str) -> tuple[str, str] | None:
    """HF name -> (our block prefix or "", our name or the HF rest for special cases)."""
    if name.startswith("model.language_model."):  # Qwen3.5's multimodal checkpoints
        name = "model." + name.removeprefix("model.language_model.")
    top = {
        "model.embed_tokens.weight": "embed.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        **HYBRID_HF_MTP,
    }
    if name in top:
        return "", top[name]
    m = _HF_BLOCK_RE.match(name)
    if m is None:
        return None  # vision tower and anything else we do not run
    prefix = f"layers.{m.group(1)}" if m.group(1) is not None else f"mtp.layers.{m.group(2)}"
    rest = m.group(3)
    return prefix, HYBRID_HF_BLOCK.get(rest, rest)


def _split_qkvz(w: torch.Tensor, cfg: HybridConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_qkvz [HK * (2K + 2 r V), D], grouped per key head (r = HV / HK) ->
    qkv [2 HK K + HV V, D] (all q, all k, all v) and z [HV V, D] (transformers'
    fix_query_key_value_ordering, done on the weight)."""
    hk, kd = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    rv = cfg.value_dim // hk
    q, k, v, z = w.reshape(hk, 2 * kd + 2 * rv, -1).split([kd, kd, rv, rv], dim=1)
    flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def _split_ba(w: torch.Tensor, cfg: HybridConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_ba [HK * 2r, D], grouped per key head -> b, a [HV, D]."""
    hk = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk
    b, a = w.reshape(hk, 2 * r, -1).split([r, r], dim=1)
    return b.reshape(hk * r, -1), a.reshape(hk * r, -1)


def _is_one_plus_norm(ours: str) -> bool:
    """(1 + w) norms: every RMSNorm except the Gated DeltaNet's gated one."""
    return ours.endswith("norm.weight") and not ours.endswith("gdn.norm.weight")


def split_special(
    prefix: str, ours: str, t: torch.Tensor, cfg: HybridConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors stored fused or in another form -> our tensors (the rest pass through)."""
    p = f"{prefix}." if prefix else ""
    if ours in ("linear_attn.in_proj_qkvz.weight", "gdn.qkvz"):
        qkv, z = _split_qkvz(t, cfg)
        yield from ((f"{p}gdn.qkv.weight", qkv), (f"{p}gdn.z.weight", z))
    elif ours in ("linear_attn.in_proj_ba.weight", "gdn.ba"):
        b, a = _split_ba(t, cfg)
        yield from ((f"{p}gdn.b.weight", b), (f"{p}gdn.a.weight", a))
    elif ours == "ffn.gate_up_exps":
        gate, up = t.chunk(2, dim=1)
        yield from ((f"{p}ffn.gate_exps", gate), (f"{p}ffn.up_exps", up))
    elif ours == "gdn.conv":
        yield f"{p}gdn.conv", t.reshape(t.shape[0], -1)  # [C, 1, W] or [C, W]
    elif ours == "ffn.shared_gate.weight":
        yield f"{p}{ours}", t.reshape(1, -1)  # llama.cpp may store it as [D]
    else:
        yield f"{p}{ours}", t


def hf_tensors(
    cfg: HybridConfig, raw: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs -> (our name, tensor) pairs; per-expert tensors are stacked
    into [E, ...] once all experts of a layer have been read."""
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
    for name, t in raw:
        mapped = _hf_ours(name)
        if mapped is None:
            continue
        prefix, ours = mapped
        if m := _HF_EXPERT_RE.match(ours):
            bucket = experts[(prefix, m.group(2))]
            bucket[int(m.group(1))] = t
            if len(bucket) == cfg.num_experts:
                stacked = torch.stack([bucket[e] for e in range(cfg.num_experts)])
                yield f"{prefix}.ffn.{m.group(2)}_exps", stacked
                bucket.clear()
            continue
        if _is_one_plus_norm(ours):
            t = t.double() + 1.0  # our RMSNorm multiplies by w; fold the 1 in once
        yield from split_special(prefix, ours, t, cfg)
    left = [f"{p}.{kind}" for (p, kind), b in experts.items() if b]
    if left:
        raise SpecserveError(f"incomplete expert weights for {left[:3]}")


def config_from_gguf(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> HybridConfig:
    """llama.cpp metadata + tensor shapes (numpy order) -> HybridConfig."""
    g = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{g}.{key}", default)
        if value is None:
            raise SpecserveError(f"GGUF metadata lacks {g}.{key}")
        return value

    mtp = int(get("nextn_predict_layers", 0))
    n_layers = int(get("block_count")) - mtp
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    v_heads = int(get("ssm.time_step_rank"))
    recurrent = meta.get(f"{g}.attention.recurrent_layers")  # optional per-layer flags
    layer_types = (
        [LINEAR if r else FULL for r in recurrent[:n_layers]]
        if isinstance(recurrent, list)
        else _pattern(n_layers, int(get("full_attention_interval", 4)))
    )
    experts = int(get("expert_count", 0))
    return HybridConfig(
        arch=GGUF_ARCHS[g],
        vocab_size=int(shapes["token_embd.weight"][0]),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", 0)),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        context_length=int(get("context_length", 4096)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        qk_norm=True,
        tie_word_embeddings="output.weight" not in shapes,
        layer_types=layer_types,
        linear_num_key_heads=int(get("ssm.group_count")),
        linear_num_value_heads=v_heads,
        linear_key_head_dim=int(get("ssm.state_size")),
        linear_value_head_dim=int(get("ssm.inner_size")) // v_heads,
        conv_kernel=int(get("ssm.conv_kernel", 4)),
        rotary_dim=int(get("rope.dimension_count", head_dim // 4)),
        num_experts=experts,
        num_experts_per_tok=int(get("expert_used_count", 0)),
        moe_intermediate_size=int(get("expert_feed_forward_length", 0)),
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)),
        moe_layers=[f"blk.{i}.ffn_gate_inp.weight" in shapes for i in range(n_layers)],
        mtp_layers=mtp,
    )


def untile_v_heads(t: torch.Tensor, dim: int, cfg: HybridConfig, head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's Qwen3.5 value-head reorder along `dim`: tiled order (head j of
    every key group, then j + 1, ...) back to grouped order (a key head's value heads
    together), which is what the ops' repeat_interleave sharing expects."""
    hk = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk
    shape = list(t.shape)
    dim = dim % len(shape)
    t = t.reshape(*shape[:dim], r, hk, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _untile_gdn(ours: str, t: torch.Tensor, cfg: HybridConfig) -> torch.Tensor:
    """Qwen3.5 GGUF value-head order -> ours, for the Gated DeltaNet tensors that have it."""
    v = cfg.linear_value_head_dim
    if ours.endswith(("gdn.qkv.weight", "gdn.conv")):
        split = 2 * cfg.key_dim
        return torch.cat((t[:split], untile_v_heads(t[split:], 0, cfg, v)))
    if ours.endswith("gdn.z.weight"):
        return untile_v_heads(t, 0, cfg, v)
    if ours.endswith(("gdn.b.weight", "gdn.a.weight", "gdn.dt_bias", "gdn.A_log")):
        return untile_v_heads(t, 0, cfg, 1)
    if ours.endswith("gdn.out.weight"):
        return untile_v_heads(t, 1, cfg, v)
    return t


def gguf_name(name: str, cfg: HybridConfig) -> tuple[str, str] | None:
    """GGUF tensor name -> (our block prefix or "", our name), None for unused tensors."""
    top = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight"}
    top["output.weight"] = "lm_head.weight"
    if name in top:
        return "", top[name]
    m = re.match(r"^blk\.(\d+)\.(.+)$", name)
    if m is None or m.group(2) not in HYBRID_GGUF_BLOCK:
        return None
    i, ours = int(m.group(1)), HYBRID_GGUF_BLOCK[m.group(2)]
    if i < cfg.num_layers:
        return f"layers.{i}", ours
    if m.group(2).startswith("nextn."):
        return ("mtp", ours) if i == cfg.num_layers else None
    return f"mtp.layers.{i - cfg.num_layers}", ours


def gguf_tensors(
    cfg: HybridConfig, raw: Iterator[tuple[str, torch.Tensor | QuantizedTable]]
) -> Iterator[tuple[str, torch.Tensor | QuantizedTable]]:
    """(GGUF name, float tensor in numpy order) -> (our name, tensor); QuantizedTables (the
    embedding and LM head, top-level names) pass through."""
    tiled = cfg.arch == "qwen3_5" and cfg.linear_num_key_heads != cfg.linear_num_value_heads
    for name, t in raw:
        mapped = gguf_name(name, cfg)
        if mapped is None:
            continue
        prefix, ours = mapped
        if isinstance(t, QuantizedTable):
            yield f"{prefix}.{ours}" if prefix else ours, t
            continue
        if ours == "gdn.A_log":
            t = torch.log(-t.double())  # llama.cpp stores A = -exp(A_log)
        for full, out in split_special(prefix, ours, t, cfg):
            yield full, _untile_gdn(full, out, cfg) if tiled else out


def read_hf(
    hf: dict[str, Any], files: list[Path]
) -> tuple[HybridConfig, Iterator[tuple[str, torch.Tensor]]]:
    """config.json contents and the folder's safetensors files -> config, tensor stream."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update(st.keys())
    cfg = config_from_hf(hf, names)

    def raw() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if _hf_ours(name) is not None:  # skip the vision tower unread
                        yield name, st.get_tensor(name)

    return cfg, hf_tensors(cfg, raw())


def read_gguf(
    reader: Any,
    meta: dict[str, Any],
    drop: Callable[[Any], None],
    raw_table: Callable[[str, Any], QuantizedTable | None],
) -> tuple[HybridConfig, Iterator[tuple[str, torch.Tensor | QuantizedTable]], dict[str, Any]]:
    """An open GGUFReader and its metadata -> config, tensor stream, metadata (the
    embedding and LM head come as QuantizedTables when block-quantized, as in gguf.py).
    gguf.py, which calls it, hands in its page dropper and its raw-table rule."""
    from gguf.quants import dequantize

    by_name = {t.name: t for t in reader.tensors}
    # the reader gives ggml's dimension order; ours (and numpy's) is the reverse
    shapes = {n: tuple(int(x) for x in reversed(t.shape.tolist())) for n, t in by_name.items()}
    cfg = config_from_gguf(meta, shapes)
    # the GGUF type each tensor was stored in, under our (block) names (for --weights auto)
    meta["specserve.tensor_types"] = {
        ".".join(filter(None, m)): t.tensor_type.name
        for n, t in by_name.items()
        if (m := gguf_name(n, cfg))
    }

    def raw() -> Iterator[tuple[str, torch.Tensor | QuantizedTable]]:
        for name, t in by_name.items():
            mapped = gguf_name(name, cfg)
            if mapped is None:
                continue
            if (table := raw_table(mapped[1], t)) is not None:
                drop(t)
                yield name, table
                continue
            array = dequantize(t.data, t.tensor_type)
            w = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
            drop(t)
            yield name, w

    return cfg, gguf_tensors(cfg, raw()), meta
