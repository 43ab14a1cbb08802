"""EAGLE-3 heads: read from the public layouts, checked against their target, and saved.

Layouts read (all map onto models/eagle3.py `Eagle3Head`):

- SpecForge / lmsys `LlamaForCausalLMEagle3`: config.json + safetensors, the decoder layer
  under `midlayer.*`, then `fc`, `norm`, `lm_head`, `d2t` (offsets: target id = j + d2t[j]),
  `t2d` (unused here), `embed_tokens` optional.
- vLLM / AngelSlim `Eagle3LlamaForCausalLM` and vLLM speculators' `Eagle3Speculator`: the
  same tensors with the layer under `layers.0.*` (optionally `model.`-prefixed); the llama
  fields nested in `transformer_layer_config` for the latter; tapped layers in
  `eagle_aux_hidden_state_layer_ids` (top level or under `eagle_config`).
- llama.cpp's `eagle3` GGUF: `fc`, `blk.0.{attn_norm (embedding), attn_norm_2 (hidden),
  attn_q/k/v (rope-permuted), attn_output, ffn_norm, ffn_*}`, `output(_norm)`, `d2t` as
  absolute ids, `eagle3.target_layers` / `eagle3.target_hidden_size` in the metadata.

Heads are saved in the SpecForge layout, which vLLM, SGLang and llama.cpp's converter load.
A head named instead of a path lives in `$SPECSERVE_CACHE/heads/<name>` (`<model>-eagle3`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specserve.errors import SpecserveError
from specserve.loading.gguf import metadata, open_gguf, unpermute_rope
from specserve.loading.hf import _rope
from specserve.loading.model import quantize_floats
from specserve.loading.sources import cache_dir
from specserve.models.config import ModelConfig
from specserve.models.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    HeadCalibration,
    default_aux_layers,
    taps_fit,
)

# the decoder layer's HF names (after its prefix) -> ours in Eagle3Head
_HF_LAYER = {
    "input_layernorm": "embed_norm",
    "hidden_norm": "hidden_norm",
    "self_attn.q_proj": "attn.q",
    "self_attn.k_proj": "attn.k",
    "self_attn.v_proj": "attn.v",
    "self_attn.o_proj": "attn.o",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "mlp.gate",
    "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down",
}
_HF_TOP = {"fc": "fc", "norm": "norm", "lm_head": "lm_head", "embed_tokens": "embed"}
_GGUF_LAYER = {
    "attn_norm": "embed_norm",
    "attn_norm_2": "hidden_norm",
    "attn_q": "attn.q",
    "attn_k": "attn.k",
    "attn_v": "attn.v",
    "attn_output": "attn.o",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "mlp.gate",
    "ffn_up": "mlp.up",
    "ffn_down": "mlp.down",
}
_GGUF_TOP = {"fc": "fc", "output_norm": "norm", "output": "lm_head", "token_embd": "embed"}
_LAYER_PREFIXES = ("midlayer.", "model.layers.0.", "layers.0.")


def hf_name_to_ours(name: str) -> str | None:
    """An EAGLE-3 checkpoint's tensor name -> ours (None: not used, e.g. t2d)."""
    if name == "d2t":
        return "d2t"
    for prefix in _LAYER_PREFIXES:
        if name.startswith(prefix):
            stem, _, kind = name[len(prefix) :].rpartition(".")
            return f"{_HF_LAYER[stem]}.{kind}" if stem in _HF_LAYER else None
    stem, _, kind = name.removeprefix("model.").rpartition(".")
    return f"{_HF_TOP[stem]}.{kind}" if stem in _HF_TOP else None


def own_head_name(model: str | os.PathLike[str]) -> str:
    """The name `train-head` gives a model's head in the cache: <model>-eagle3, <model>
    being a model's name (dots kept: qwen2.5-coder-0.5b), a GGUF file's stem or a folder's
    name."""
    return f"{model_stem(model)}-eagle3"


def model_stem(model: str | os.PathLike[str]) -> str:
    """A model's name, a GGUF file's stem or a folder's name (dots kept)."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def own_head_dir(model: str | os.PathLike[str]) -> Path:
    """Where `train-head` saves a model's head by default, and a server looks for it."""
    return cache_dir() / "heads" / own_head_name(model)


def has_own_head(model: str | os.PathLike[str]) -> bool:
    """Whether `train-head` has saved a head for the model: its folder holds no more than a
    checkpoint while a first run trains, or after one was stopped (config.json comes last)."""
    return (own_head_dir(model) / "config.json").is_file()


def resolve_head(spec: str | os.PathLike[str]) -> Path:
    """A head's path: as given, or its name under $SPECSERVE_CACHE/heads/."""
    given = Path(spec)
    if given.exists():
        return given
    heads = cache_dir() / "heads"
    for candidate in (heads / str(spec), heads / f"{spec}-eagle3"):
        if candidate.exists():
            return candidate
    raise SpecserveError(
        f"no EAGLE-3 head {str(spec)!r}: not a path, nor a head in {heads} "
        "(train one with `specserve train-head --model M`)"
    )


def _layer_config(hf: dict[str, Any]) -> ModelConfig:
    heads = hf["num_attention_heads"]
    rope = _rope(hf, "full_attention")
    return ModelConfig(
        arch="llama",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=1,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        context_length=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope["theta"],
        rope_scale=rope["scale"],
        attention_bias=bool(hf.get("attention_bias", False)),
    )


def config_from_hf(hf: dict[str, Any], target: ModelConfig) -> Eagle3Config:
    """An EAGLE-3 config.json (any of the layouts) -> Eagle3Config for `target`."""
    hf = {**hf, **(hf.get("transformer_layer_config") or {})}
    if hf.get("num_hidden_layers", 1) != 1:
        raise SpecserveError("an EAGLE-3 head has one decoder layer")
    if hf.get("norm_before_fc"):
        raise SpecserveError("EAGLE-3 heads with norm_before_fc are not supported")
    eagle = hf.get("eagle_config") or {}
    aux = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    layer = _layer_config(hf)
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=int(hf.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=int(hf.get("target_hidden_size") or target.hidden_size),
        aux_layers=tuple(aux) if aux else default_aux_layers(target.num_layers),
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
    )


def read_hf_head(folder: Path, target: ModelConfig) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").exists() or not files:
        raise SpecserveError(f"{folder}: an EAGLE-3 head needs config.json and *.safetensors")
    cfg = config_from_hf(json.loads((folder / "config.json").read_text()), target)
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                if (ours := hf_name_to_ours(name)) is not None:
                    tensors[ours] = st.get_tensor(name)
    if "d2t" in tensors:  # offsets -> absolute target ids
        d2t = tensors["d2t"].long()
        tensors["d2t"] = d2t + torch.arange(d2t.numel())
    return cfg, tensors


def _gguf_tensors(reader: Any, layer: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name == "d2t":
            yield "d2t", torch.from_numpy(t.data.astype("int64").reshape(-1))
            continue
        stem, _, kind = t.name.rpartition(".")
        block = stem.removeprefix("blk.0.")
        ours = _GGUF_LAYER.get(block) if block != stem else _GGUF_TOP.get(stem)
        if ours is None:
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32").copy())
        if block in ("attn_q", "attn_k"):  # llama.cpp interleaves each head's rope halves
            w = unpermute_rope(w, layer.num_heads if block == "attn_q" else layer.num_kv_heads)
        yield f"{ours}.{kind}", w


def read_gguf_head(path: Path, target: ModelConfig) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    reader = open_gguf(path)
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "eagle3":
        raise SpecserveError(f"{path}: a GGUF of architecture {arch!r}, not an eagle3 head")

    def get(key: str, default: Any = None) -> Any:  # noqa: ANN401
        return meta.get(f"eagle3.{key}", default)

    if get("norm_before_fc"):
        raise SpecserveError("EAGLE-3 heads with norm_before_fc are not supported")
    names = {t.name: t for t in reader.tensors}
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    out = names.get("output.weight")
    layer = ModelConfig(
        arch="llama",
        vocab_size=target.vocab_size,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=1,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        context_length=int(get("context_length", 4096)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
    )
    cfg = Eagle3Config(
        layer=layer,
        draft_vocab_size=int(out.shape[-1]) if out is not None else target.vocab_size,
        target_hidden_size=int(get("target_hidden_size", target.hidden_size)),
        aux_layers=tuple(int(i) for i in get("target_layers", ())),
        norm_before_residual=bool(get("norm_before_residual", False)),
    )
    return cfg, dict(_gguf_tensors(reader, layer))


def check_head(cfg: Eagle3Config, target: ModelConfig, where: str) -> None:
    """The head must read what the target has: its hidden size, vocabulary, layers."""
    problems = []
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(
            f"it reads hidden states of size {cfg.target_hidden_size}, "
            f"the target's are {target.hidden_size}"
        )
    if cfg.vocab_size != target.vocab_size:
        problems.append(
            f"its vocabulary has {cfg.vocab_size} tokens, the target's {target.vocab_size}"
        )
    if cfg.draft_vocab_size > target.vocab_size:
        problems.append(
            f"its draft vocabulary ({cfg.draft_vocab_size}) is larger than the target's"
        )
    if not taps_fit(cfg.aux_layers, target.num_layers):
        problems.append(
            f"it taps layers {list(cfg.aux_layers)}, the target has 0..{target.num_layers - 1}"
        )
    if problems:
        raise SpecserveError(f"EAGLE-3 head {where} does not fit the model: " + "; ".join(problems))


def load_eagle3(
    spec: str | os.PathLike[str],
    target: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    weights: str = "dequant",
) -> Eagle3Head:
    """An EAGLE-3 head (a path, or a name in the cache) for a target of config `target`;
    weights: its kernels (--draft-weights, as the engine resolves it; a float32 head beside
    int8 weights cost a quarter of a step), auto meaning int8 here."""
    path = resolve_head(spec)
    reader = read_gguf_head if path.suffix == ".gguf" else read_hf_head
    cfg, tensors = reader(path, target)
    check_head(cfg, target, str(path))
    head = Eagle3Head(cfg)
    if "embed.weight" in tensors:
        head.embed = torch.nn.Embedding(*tensors["embed.weight"].shape)
    d2t = tensors.pop("d2t", torch.arange(cfg.draft_vocab_size))
    if d2t.shape != (cfg.draft_vocab_size,) or d2t.min() < 0 or d2t.max() >= target.vocab_size:
        raise SpecserveError(f"EAGLE-3 head {path}: d2t does not map into the target's vocabulary")
    state = {**tensors, "d2t": d2t}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SpecserveError(f"EAGLE-3 head {path}: missing {missing}, unexpected {unexpected}")
    head.d2t = d2t.long()
    head.calibration = read_calibration(path)
    return quantize_floats(head.to(device=device), weights, dtype, device).eval()


# beside a head in its folder: what train-head measured of it on held-out text. Other
# engines' loaders read config.json and the weights only, so the layout stays theirs.
CALIBRATION = "calibration.json"


def save_calibration(cal: HeadCalibration, folder: Path) -> None:
    (folder / CALIBRATION).write_text(json.dumps(dataclasses.asdict(cal), indent=2) + "\n")


def read_calibration(path: Path) -> HeadCalibration | None:
    """The calibration saved in a head's folder; None for a GGUF file or a folder without."""
    file = path / CALIBRATION
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text())
        cal = HeadCalibration(
            tuple(float(b) for b in raw["bounds"]),
            tuple(int(k) for k in raw["first_kept"]),
            tuple(int(n) for n in raw["first_rows"]),
            float(raw["p_min"]),
            int(raw["later_kept"]),
            int(raw["later_rows"]),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise SpecserveError(
            f"{file}: not a head calibration ({e}); delete it or train again"
        ) from e
    classes = len(cal.bounds) + 1
    counts = [*zip(cal.first_kept, cal.first_rows, strict=False), (cal.later_kept, cal.later_rows)]
    if (
        len(cal.first_kept) != classes
        or len(cal.first_rows) != classes
        or any(not 0 <= k <= n for k, n in counts)
    ):
        raise SpecserveError(f"{file}: its counts do not fit its {classes} classes")
    return cal


def save_eagle3(head: Eagle3Head, folder: Path) -> None:
    """Write the head in SpecForge's `LlamaForCausalLMEagle3` layout (float32 weights)."""
    from safetensors.torch import save_file

    cfg, lc = head.cfg, head.cfg.layer
    folder.mkdir(parents=True, exist_ok=True)
    ours_to_hf = {v: k for k, v in _HF_LAYER.items()}
    state: dict[str, torch.Tensor] = {}
    for name, t in head.state_dict().items():
        stem, _, kind = name.rpartition(".")
        if name == "d2t":
            d2t = t.long().cpu()
            state["d2t"] = d2t - torch.arange(d2t.numel())  # absolute ids -> offsets
            t2d = torch.zeros(lc.vocab_size, dtype=torch.bool)
            t2d[d2t] = True
            state["t2d"] = t2d
            continue
        hf = f"midlayer.{ours_to_hf[stem]}" if stem in ours_to_hf else stem
        hf = "embed_tokens" if hf == "embed" else hf
        state[f"{hf}.{kind}"] = t.detach().to(torch.float32).cpu().contiguous()
    save_file(state, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": lc.num_heads,
        "num_key_value_heads": lc.num_kv_heads,
        "head_dim": lc.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": lc.context_length,
        "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": lc.rope_theta,
        "attention_bias": lc.attention_bias,
        "tie_word_embeddings": False,
        "vocab_size": lc.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers)},
        "norm_before_residual": cfg.norm_before_residual,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
