"""One entry point: a model name, `.gguf` path or HF folder -> a ready model + tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from tqdm import tqdm

from specserve.errors import SpecserveError
from specserve.loading.convert import LinearConverter
from specserve.loading.gguf import TENSOR_TYPES_KEY, Tensors, read_gguf
from specserve.loading.hf import read_hf
from specserve.loading.hugepages import records_to_huge_pages
from specserve.loading.names import keeps_precision
from specserve.loading.sources import resolve_model
from specserve.loading.tokenizer import Tokenizer, load_tokenizer
from specserve.models import registry
from specserve.models.config import ModelConfig
from specserve.models.layers.embedding import QuantizedEmbedding, QuantizedTable
from specserve.models.layers.lowbit import LowbitLinear
from specserve.models.layers.lowbit_fused import fuse_lowbit
from specserve.models.layers.lowbit_pairs import tune_pairs
from specserve.models.layers.packed import pack_linears
from specserve.models.layers.quant import (
    WEIGHT_MODES,
    Int4Linear,
    Int8Linear,
    auto_mode,
    quantized_kernels_run,
    swap_linears,
)
from specserve.models.registry import LanguageModel
from specserve.ops.cpu.build import available as lowbit_available
from specserve.ops.cpu.build import problem as lowbit_problem
from specserve.trim import release_freed_memory

M = TypeVar("M", bound=torch.nn.Module)
log = logging.getLogger(__name__)

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
    tensors: Tensors,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: bool = False,
    quantize: tuple[str, dict[str, str], bool] | None = None,
    head_packed: bool = False,
) -> LanguageModel:
    """Create the model on the meta device and assign the loaded tensors (no random init).

    quantize: (weights mode, GGUF types, lowbit kernels): the linears that mode quantizes
    are quantized as their tensors arrive (loading/convert.py).
    A block-quantized GGUF embedding table (a QuantizedTable in the stream) stays in its
    blocks on CPU (QuantizedEmbedding), unless the LM head is tied to it, stays float
    (dequant mode) and is not packed: that head is the float table, which the embedding
    then shares. head_packed: the caller packs a float LM head afterwards (pack_linears),
    which makes it a copy of its own."""
    with torch.device("meta"):
        model = registry.build(cfg)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    expected = set(shapes)
    converter = None
    if quantize is not None:
        weights, types, lowbit = quantize
        converter = LinearConverter(model, linear_modes(model, weights, types), lowbit)
    # norms (and GDN decay terms) stay in float32 under 16-bit dtypes: they are tiny and
    # rounding them costs accuracy
    norm_dtype = torch.float32 if dtype.itemsize < 4 else dtype
    state: dict[str, torch.Tensor] = {}
    streamed: set[str] = set()
    table: QuantizedTable | None = None  # the embedding's blocks, kept as they are
    for name, t in tqdm(
        tensors, desc="load", unit="tensor", disable=not progress, total=len(expected)
    ):
        streamed.add(name)
        if isinstance(t, QuantizedTable):
            _check_shape(name, t, shapes)
            if name == "embed.weight" and torch.device(device).type == "cpu":
                table = t
                continue
            if converter is not None and converter.owns(name):
                _convert(converter, name, t)  # quantized a range of rows at a time
                continue
            t = t.dequantize()
        t = t.to(device=device, dtype=norm_dtype if keeps_precision(name) else dtype)
        if converter is not None and converter.owns(name):
            _check_shape(name, t, shapes)
            _convert(converter, name, t)
            continue
        state[name] = t
    if table is not None:
        tied = "lm_head.weight" in shapes and "lm_head.weight" not in streamed
        if tied and (converter is None or "lm_head" not in converter.modes):
            # a float head tied to the table needs the float table anyway
            floats = table.dequantize().to(device=device, dtype=dtype)
            if head_packed:
                # ... until pack_linears gives it its own packed copy, after which the
                # float table would serve the embedding alone: keep that in blocks
                state["lm_head.weight"] = floats
            else:
                state["embed.weight"] = floats  # the embedding shares it (no saving)
                table = None
        elif tied:
            assert converter is not None
            _convert(converter, "lm_head.weight", table)  # a range of rows at a time
        if table is not None:
            model.embed = QuantizedEmbedding(table, dtype)
            expected.discard("embed.weight")
        del table
    if converter is not None:
        converter.install(model, state)  # a tied LM head is quantized from the embedding
        expected -= {f"{n}.{leaf}" for n in converter.modes for leaf in ("weight", "bias")}
    if "lm_head.weight" in expected and "lm_head.weight" not in state and "embed.weight" in state:
        state["lm_head.weight"] = state["embed.weight"]  # tied: one tensor serves both
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise SpecserveError(
            f"weights do not fit the {cfg.arch} config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    for name, t in state.items():
        _check_shape(name, t, shapes)
    # not strict: the quantized modules' buffers are already in place (keys checked above)
    model.load_state_dict(state, assign=True, strict=False)
    return model.eval()


def _convert(converter: LinearConverter, name: str, t: torch.Tensor | QuantizedTable) -> None:
    """Hand a tensor to the converter, then give malloc's freed pages back: quantizing
    leaves its float temporaries in the heap, and they added up in the load's peak; a trim
    without gc is cheap (figures: docs/perf/memory.md)."""
    converter.take(name, t)
    release_freed_memory(collect=False)


def _check_shape(
    name: str, t: torch.Tensor | QuantizedTable, shapes: dict[str, torch.Size]
) -> None:
    if t.shape != shapes[name]:
        raise SpecserveError(
            f"tensor {name} has shape {tuple(t.shape)}, the config wants {tuple(shapes[name])}"
        )


def linear_modes(model: torch.nn.Module, weights: str, types: dict[str, str]) -> dict[str, str]:
    """Which nn.Linear modules --weights quantizes, and how (types: our name -> GGUF type)."""
    if weights not in WEIGHT_MODES:
        raise SpecserveError(
            f"unknown --weights {weights!r}; choose from {', '.join(WEIGHT_MODES)}"
        )
    if weights == "dequant":
        return {}
    modes = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        mode = auto_mode(_gguf_type(name, types)) if weights == "auto" else weights
        if mode is not None:
            modes[name] = mode
    return modes


def _gguf_type(linear: str, types: dict[str, str]) -> str:
    # a tied LM head has no tensor of its own: it is the embedding's
    if linear == "lm_head" and "lm_head.weight" not in types:
        return types.get("embed.weight", "")
    return types.get(f"{linear}.weight", "")


def _use_lowbit(compute: torch.dtype, device: torch.device | str) -> bool:
    """Our float32 kernels where they apply; torch's bf16 ones otherwise."""
    if compute != torch.float32 or torch.device(device).type != "cpu":
        return False
    if lowbit_available():
        return True
    log.warning("low-bit CPU kernels unavailable (%s); using torch's bf16 ones", lowbit_problem())
    return False


def _cast_floats(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast float parameters to dtype, leaving quantized layers' buffers and (under 16-bit
    dtypes) the float32 norms alone."""
    for name, module in model.named_modules():
        if isinstance(module, QuantizedEmbedding):
            module.dtype = dtype  # its rows are cast to the compute dtype as they are looked up
        if isinstance(module, Int4Linear | Int8Linear | LowbitLinear | QuantizedEmbedding):
            continue
        for pname, p in module.named_parameters(recurse=False):
            keep32 = dtype.itemsize < 4 and keeps_precision(f"{name}.{pname}")
            if p.is_floating_point() and not keep32:
                p.data = p.data.to(dtype)


def quantize_floats(module: M, weights: str, compute: torch.dtype, device: torch.device | str) -> M:
    """A float32 module's linears on --weights' kernels, the rest cast to `compute` (its
    weights have no GGUF types, so auto means int8). Where no quantized kernel runs (dequant,
    float64, off the CPU) it is only cast."""
    if weights == "dequant" or not quantized_kernels_run(compute, device):
        return module.to(dtype=compute)
    mode = "int8" if weights == "auto" else weights
    swap_linears(module, linear_modes(module, mode, {}), _use_lowbit(compute, device))
    fuse_lowbit(module)  # q/k/v and gate/up as one call each, as a loaded model's
    _cast_floats(module, compute)
    return module


def load_model(
    spec: str | Path,
    dtype: str | torch.dtype = "float32",
    device: torch.device | str = "cpu",
    with_tokenizer: bool = True,
    progress: bool = False,
    weights: str = "dequant",
    prepack: bool = True,
) -> LoadedModel:
    """weights: dequant (float weights in `dtype`), int8, int6, int5, int4, or auto (each
    tensor on the kernel nearest its GGUF precision; float tensors stay float).
    prepack: float32 linears on CPU run on oneDNN's pre-packed weights (layers/packed.py)."""
    path = resolve_model(spec)
    types: dict[str, str] = {}
    tensors: Tensors
    if path.is_dir():
        cfg, tensors = read_hf(path)
        has_tok = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    else:
        cfg, tensors, meta = read_gguf(path)
        types = meta[TENSOR_TYPES_KEY]
        has_tok = True
    compute = parse_dtype(dtype)
    if weights == "auto" and not quantized_kernels_run(compute, device):
        weights = "dequant"  # auto keeps floats where no quantized kernel runs
    quantized = weights != "dequant"
    if quantized and torch.device(device).type != "cpu":
        raise SpecserveError(
            "--weights int8/int6/int5/int4/auto runs on torch's CPU kernels; use dequant on GPU"
        )
    # quantize from float32, not from weights already rounded to the compute dtype
    lowbit = quantized and _use_lowbit(compute, device)
    quantize = (weights, types, lowbit) if quantized else None
    build_dtype = torch.float32 if quantized else compute
    # pack_linears gives a float32 LM head its own copy of the weights
    head_packed = (
        prepack
        and build_dtype == torch.float32
        and torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
    )
    model = build_model(cfg, tensors, build_dtype, device, progress, quantize, head_packed)
    if quantized:
        if lowbit:
            fuse_lowbit(model)
            records_to_huge_pages(model)  # fewer TLB misses per step (loading/hugepages.py)
            tune_pairs(model)
        _cast_floats(model, compute)
    if prepack:
        pack_linears(model)  # only float32 CPU linears; a no-op otherwise
    tokenizer = load_tokenizer(path) if with_tokenizer and has_tok else None
    return LoadedModel(model, tokenizer, path)
