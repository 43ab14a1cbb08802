"""A token embedding that keeps a GGUF table in its quantized blocks.

Dequantized to float32, a GGUF embedding table is the largest tensor of a small model:
Qwen2.5-Coder-0.5B's 151936 x 896 is 545 MB as float32 and 94 MB as the file's Q5_0, and
a forward looks up only its own tokens' rows. `QuantizedEmbedding` holds the raw blocks
(uint8 [vocab, bytes per row], copied out of the file's memory map) and dequantizes just the
rows asked for, with the function the loader dequantizes whole tables with
(`gguf.quants.dequantize`). Every GGML format dequantizes block by block, so a row comes out
bit for bit as it does in the whole table; rows are then cast to the model's dtype, as the
float table was (tests/models/test_embedding.py).

A decode step looks up one row per slot, and an EAGLE-3 head one per draft step, each
through the gguf package's numpy dequantizer, whose per-call cost was a sizeable share of
a head step on the 0.5B (docs/perf/2026-11-28-eagle3-calibrated.md); so the rows of small
lookups are kept (`ROW_CACHE`, the least recently used dropped first).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, cast

import numpy as np
import torch
from torch import nn

# rows kept of small lookups: a few MB, and an answer uses far fewer distinct tokens
ROW_CACHE = 4096
SMALL = 16  # lookups of up to this many ids use the kept rows; a prompt's go straight through

# GGML types that are plain numbers, not blocks: their tables stay nn.Embedding
FLOAT_TYPES = frozenset(("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"))


def is_quantized(gguf_type: str) -> bool:
    """Whether a GGML tensor type (by name: "Q5_0") is a block-quantized format."""
    return gguf_type not in FLOAT_TYPES


def _dequantize(blocks: np.ndarray, gguf_type: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    array = dequantize(blocks, GGMLQuantizationType[gguf_type])
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


class QuantizedTable:
    """A 2-D GGUF tensor [rows, cols] kept as its raw blocks: `data` uint8 [rows, bytes per
    row] in ordinary memory, and its GGML type. The loader streams the embedding table and
    the LM head this way, so they can be dequantized a range of rows at a time."""

    def __init__(self, data: torch.Tensor, gguf_type: str, cols: int) -> None:
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise ValueError(f"GGUF blocks are uint8 [rows, bytes], got {data.dtype} {data.shape}")
        self.data, self.gguf_type, self.cols = data, gguf_type, cols

    @classmethod
    def from_gguf(cls, tensor: Any) -> QuantizedTable:
        """A copy of a GGUFReader tensor's blocks (not a view of the file's memory map)."""
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, order="C", copy=True))
        rows, cols = (int(x) for x in reversed(tensor.shape.tolist()))
        return cls(data.view(rows, -1), tensor.tensor_type.name, cols)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """float32 [stop - start, cols]: rows start..stop-1 dequantized."""
        return self._floats(self.data[start:stop])

    def dequantize(self) -> torch.Tensor:
        """The whole table in float32 (what the loader held before this class)."""
        return self.rows()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), cols]: the rows of the (flat, CPU, int64) ids."""
        return self._floats(self.data.index_select(0, ids))

    def _floats(self, data: torch.Tensor) -> torch.Tensor:
        if data.shape[0] == 0:  # the gguf package cannot reshape zero blocks
            return torch.empty(0, self.cols)
        out = _dequantize(data.numpy(), self.gguf_type)
        return out.view(data.shape[0], self.cols)


class QuantizedEmbedding(nn.Module):
    """nn.Embedding's forward on a QuantizedTable: ids [...] -> rows [..., dim] in `dtype`
    (the rows are dequantized to float32, then cast, as the float table was)."""

    raw: torch.Tensor  # the table's blocks, uint8 [vocab, bytes per row] (a buffer)

    def __init__(self, table: QuantizedTable, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.register_buffer("raw", table.data)
        self.gguf_type = table.gguf_type
        self.num_embeddings, self.embedding_dim = table.shape
        self.dtype = dtype
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()  # id -> row (ROW_CACHE)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def table(self) -> QuantizedTable:
        return QuantizedTable(self.raw, self.gguf_type, self.embedding_dim)

    def _apply(self, fn: Any, recurse: bool = True) -> QuantizedEmbedding:  # noqa: ANN401
        self._rows.clear()  # kept rows live where the blocks were
        return cast(QuantizedEmbedding, super()._apply(fn, recurse))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if 0 < ids.numel() <= SMALL:
            rows = self._kept(ids.reshape(-1).tolist())
        else:
            flat = ids.reshape(-1).to(device=self.raw.device, dtype=torch.long)
            rows = self.table().lookup(flat).to(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def _kept(self, ids: list[int]) -> torch.Tensor:
        """The rows of these ids in `dtype`, dequantized only where not kept already."""
        kept = self._rows
        missing = [i for i in dict.fromkeys(ids) if i not in kept]
        if missing:
            found = self.table().lookup(torch.tensor(missing, device=self.raw.device))
            for i, row in zip(missing, found.to(self.dtype), strict=True):
                kept[i] = row
        for i in ids:
            kept.move_to_end(i)
        rows = torch.stack([kept[i] for i in ids])
        while len(kept) > ROW_CACHE:
            kept.popitem(last=False)
        return rows

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, {self.gguf_type} blocks, "
            f"rows as {self.dtype}"
        )


Embedding = nn.Embedding | QuantizedEmbedding


def rows_dtype_device(embed: Embedding) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of the rows an embedding gives (the model's activations')."""
    if isinstance(embed, QuantizedEmbedding):
        return embed.dtype, embed.device
    return embed.weight.dtype, embed.weight.device
