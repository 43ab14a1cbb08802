"""One entry point: a model name, `.gguf` path or HF folder -> a ready model + tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.errors import SpecserveError
from specserve.loading.gguf import read_gguf
from specserve.loading.hf import read_hf
from specserve.loading.names import keeps_precision
from specserve.loading.sources import resolve_model
from specserve.loading.tokenizer import Tokenizer, load_tokenizer
from specserve.models import registry
from specserve.models.config import ModelConfig
from specserve.models.registry import LanguageModel

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: LanguageModel
    tokenizer: Tokenizer | None
    path: Path

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise SpecserveError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def build_model(
    cfg: ModelConfig,
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> LanguageModel:
    """Create the model on the meta device and assign the loaded tensors (no random init)."""
    with torch.device("meta"):
        model = registry.build(cfg)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    expected = set(shapes)
    # norms (and GDN decay terms) stay in float32 under 16-bit dtypes: they are tiny and
    # rounding them costs accuracy
    norm_dtype = torch.float32 if dtype.itemsize < 4 else dtype
    state: dict[str, torch.Tensor] = {}
    for name, t in tqdm(
        tensors, desc="load", unit="tensor", disable=not progress, total=len(expected)
    ):
        state[name] = t.to(device=device, dtype=norm_dtype if keeps_precision(name) else dtype)
    if "lm_head.weight" not in state and "embed.weight" in state:
        state["lm_head.weight"] = state["embed.weight"]  # tied: one tensor serves both
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise SpecserveError(
            f"weights do not fit the {cfg.arch} config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    for name, t in state.items():
        if t.shape != shapes[name]:
            raise SpecserveError(
                f"tensor {name} has shape {tuple(t.shape)}, the config wants {tuple(shapes[name])}"
            )
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def load_model(
    spec: str | Path,
    dtype: str | torch.dtype = "float32",
    device: torch.device | str = "cpu",
    with_tokenizer: bool = True,
    progress: bool = False,
) -> LoadedModel:
    path = resolve_model(spec)
    if path.is_dir():
        cfg, tensors = read_hf(path)
        has_tok = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    else:
        cfg, tensors, _ = read_gguf(path)
        has_tok = True
    model = build_model(cfg, tensors, parse_dtype(dtype), device, progress)
    tokenizer = load_tokenizer(path) if with_tokenizer and has_tok else None
    return LoadedModel(model, tokenizer, path)
