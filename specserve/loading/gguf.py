"""GGUF files -> ModelConfig + tensors under our names (the gguf package reads and dequantizes).

The embedding table and the LM head, when block-quantized, are streamed as `QuantizedTable`s
(their raw blocks) instead: the loader keeps the embedding that way and quantizes the head
a range of rows at a time (loading/model.py, loading/convert.py). Q4_K and Q6_K tensors
come as blocks too, so the low-bit kernels take their own values (loading/q4k.py, q6k.py);
every other consumer dequantizes them as before."""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specserve.errors import SpecserveError
from specserve.loading import qwen3_next as hybrid
from specserve.loading.names import gguf_to_ours
from specserve.models.config import DENSE_ARCHS, ModelConfig
from specserve.models.layers.embedding import QuantizedTable, is_quantized

TENSOR_TYPES_KEY = "specserve.tensor_types"
# the tables streamed as their raw blocks when block-quantized (the two largest tensors)
RAW_TABLES = ("embed.weight", "lm_head.weight")
# GGML types streamed as raw blocks wherever they are: a kernel takes them as they are
RAW_TYPES = ("Q4_K", "Q6_K")

Tensors = Iterator[tuple[str, torch.Tensor | QuantizedTable]]


def open_gguf(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises bare ValueError/struct errors on bad files
        raise SpecserveError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def metadata(reader: Any) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.model":
            continue  # vocab arrays are large; the tokenizer module reads them itself
        try:
            out[key] = field.contents()
        except Exception:  # noqa: S112 (a field we cannot decode is one we do not use)
            continue
    return out


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture", "?")
    if arch not in DENSE_ARCHS:
        raise SpecserveError(
            f"unsupported architecture {arch!r} in GGUF; supported: {', '.join(DENSE_ARCHS)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise SpecserveError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads, n_layers = (
        get("embedding_length"),
        get("attention.head_count"),
        get("block_count"),
    )
    head_dim = get("attention.key_length", hidden // heads)
    gemma = arch == "gemma3"
    window = meta.get(f"{arch}.attention.sliding_window") if gemma else None
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise SpecserveError(f"unsupported rope scaling {scaling!r} in GGUF")
    return ModelConfig(
        arch=arch,
        vocab_size=_vocab_size(meta, tensor_names),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        context_length=get("context_length", 4096),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        # llama.cpp defaults gemma3's local rope base to 10k and its pattern to 5 local : 1 global
        rope_theta_local=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)) if gemma else None,
        rope_scale=float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
        if scaling == "linear"
        else 1.0,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sandwich_norm=gemma,
        activation="gelu_tanh" if gemma else "silu",
        embed_scale=hidden**0.5 if gemma else 1.0,
        query_scale=None,
        sliding_window=window,
        sliding_layers=_sliding_layers(
            meta.get(f"{arch}.attention.sliding_window_pattern"), n_layers
        )
        if gemma
        else [],
        final_logit_softcap=meta.get(f"{arch}.final_logit_softcapping"),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def _sliding_layers(pattern: Any, n_layers: int) -> list[bool]:
    """A period n (every n-th layer global) or one flag per layer; gemma3's default is 6."""
    if isinstance(pattern, list):
        return [bool(x) for x in pattern]
    period = int(pattern or 6)
    return [(i + 1) % period != 0 for i in range(n_layers)]


def _vocab_size(meta: dict[str, Any], tensor_names: set[str]) -> int:
    arch = meta["general.architecture"]
    if f"{arch}.vocab_size" in meta:
        return int(meta[f"{arch}.vocab_size"])
    return -1  # filled in from token_embd's shape by read_gguf


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's rope halves for llama q/k; undo it.

    w: [n_heads * head_dim, ...] with rows (x0, y0, x1, y1, ...) per head ->
    rows (x0, x1, ..., y0, y1, ...) as the rotate-halves rope expects.
    """
    rest = w.shape[1:]
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)


def page_dropper(reader: Any) -> Callable[[Any], None]:
    """drop(tensor): let the kernel unmap the file pages of a tensor that has been copied
    out. Reading maps the file's pages into the process, where they count as resident while
    the map lasts: without this, the whole file (0.5B: 470 MB) adds to the load's peak RSS.
    The pages stay in the page cache; the map is read-only and shared, so reading the same
    bytes again maps them again. (The returned function holds the map, not the reader, whose
    parsed metadata should be freed before the tensors stream.)"""
    mm = getattr(reader.data, "_mmap", None)  # numpy.memmap's mmap object

    def drop(tensor: Any) -> None:
        if mm is None or not hasattr(mm, "madvise"):
            return
        page = mmap.PAGESIZE
        start = -(-tensor.data_offset // page) * page  # whole pages inside the tensor
        stop = (tensor.data_offset + tensor.n_bytes) // page * page
        if stop > start:
            mm.madvise(mmap.MADV_DONTNEED, start, stop - start)

    return drop


def raw_table(ours: str, tensor: Any, types: tuple[str, ...] = ()) -> QuantizedTable | None:
    """The tensor's blocks when it is one of RAW_TABLES and block-quantized, or of one of
    `types` (the dense loader's RAW_TYPES; the hybrid loader reshapes its other tensors as
    floats, so it passes none); else None."""
    kind = tensor.tensor_type.name
    if not (ours in RAW_TABLES and is_quantized(kind)) and kind not in types:
        return None
    return QuantizedTable.from_gguf(tensor)


def read_gguf(path: Path) -> tuple[ModelConfig, Tensors, dict]:
    """Config, a stream of (our name, float32 tensor or QuantizedTable) pairs, and the
    metadata."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    meta = metadata(reader)
    if meta.get("general.architecture") in hybrid.GGUF_ARCHS:
        return hybrid.read_gguf(reader, meta, page_dropper(reader), raw_table)
    by_name = {t.name: t for t in reader.tensors}
    cfg = config_from_gguf(meta, set(by_name))
    if cfg.vocab_size < 0:
        cfg.vocab_size = int(by_name["token_embd.weight"].shape[-1])

    # which GGUF type each of our tensors was stored in (for --weights auto)
    meta[TENSOR_TYPES_KEY] = {
        ours: t.tensor_type.name for name, t in by_name.items() if (ours := gguf_to_ours(name))
    }

    drop = page_dropper(reader)

    def tensors() -> Tensors:
        for name, t in by_name.items():
            ours = gguf_to_ours(name)
            if ours is None:
                continue
            if (table := raw_table(ours, t, RAW_TYPES)) is not None:
                drop(t)
                yield ours, _unpermuted(cfg, ours, table)
                continue
            try:
                array = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise SpecserveError(f"{path}: cannot read tensor {name} ({e})") from e
            array = np.ascontiguousarray(array, dtype=np.float32)
            # float tensors come back as read-only views of the file's memory map
            w = torch.from_numpy(array if array.flags.writeable else array.copy())
            drop(t)
            yield ours, _unpermuted(cfg, ours, w)

    return cfg, tensors(), meta


def _unpermuted(cfg: ModelConfig, ours: str, w: Any) -> Any:
    """llama's q/k rows back in rotate-halves order; a QuantizedTable's rows move as wholes
    (a row's blocks are its own), so its blocks are reordered the same way."""
    if cfg.arch != "llama" or not (".attn.q." in ours or ".attn.k." in ours):
        return w
    heads = cfg.num_heads if ".q." in ours else cfg.num_kv_heads
    if isinstance(w, QuantizedTable):
        return QuantizedTable(unpermute_rope(w.data, heads).contiguous(), w.gguf_type, w.cols)
    return unpermute_rope(w, heads)
