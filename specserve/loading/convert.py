"""Quantize linears while their weights stream in from the file.

Building the whole float32 model first and quantizing it after (gpt-fast's way) held every
weight in float32 at once: the 0.5B peaked at ~3.3 GB and the 1.5B at ~8.3 GB while loading,
for models that serve in ~0.6 and ~1.6 GB of quantized weights. Here each linear is
quantized as soon as its weight (and bias) arrive and the float copy is dropped. The LM head
(136M weights in Qwen2.5's 0.5B and 1.5B) is quantized CHUNK_ROWS rows at a time for our
low-bit kernels; from a GGUF it arrives as its raw blocks (a QuantizedTable) and is
dequantized chunk by chunk too, so its float32 copy never exists whole. A tied head is
quantized from the embedding's table the same way. GGUF Q4_K and Q6_K linears also arrive as
blocks and become q4k and q6 records without a float32 round trip (loading/q4k.py, q6k.py).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from specserve.errors import SpecserveError
from specserve.loading.q4k import q4k_fields
from specserve.loading.q6k import q6k_groups
from specserve.models.layers.embedding import QuantizedTable
from specserve.models.layers.lowbit import LowbitLinear, Q4KLinear, Q6KLinear
from specserve.models.layers.quant import quantize_weight
from specserve.ops.naive.lowbit import TILE

# GGUF types whose blocks become low-bit records as they are, without a float32 round trip,
# and the --weights mode that takes them so
NATIVE_TYPES = {"Q4_K": "int4", "Q6_K": "int6"}
# rows quantized at once for the low-bit kernels: a whole number of their tiles of 8 outputs
CHUNK_ROWS = 8192

Weight = torch.Tensor | QuantizedTable


def quantize_rows(
    weight: Weight, bias: torch.Tensor | None, mode: str, lowbit: bool, chunk: int | None = None
) -> nn.Module:
    """quantize_weight on a float weight or a QuantizedTable, `chunk` rows at a time where
    that gives the same module. The low-bit kernels' records hold tiles of 8 whole outputs,
    each quantized from its own row only, so the records of row chunks that fill whole tiles,
    stacked, are the records of the whole weight (as FusedLowbit stacks q, k and v);
    torch's kernels (bf16) get the whole weight."""
    n, k = weight.shape
    chunk = chunk or CHUNK_ROWS
    if not lowbit or n <= chunk:
        return _layer(weight, 0, n, bias, mode, lowbit)
    if chunk % TILE:
        raise ValueError(f"chunks of {chunk} rows do not fill whole tiles of {TILE}")
    records: torch.Tensor | None = None
    kind: type[LowbitLinear] = LowbitLinear
    for start in range(0, n, chunk):
        part = cast(LowbitLinear, _layer(weight, start, start + chunk, None, mode, lowbit))
        if records is None:
            kind = type(part)
            records = part.records.new_empty((-(-n // TILE), *part.records.shape[1:]))
        records[start // TILE : start // TILE + part.records.shape[0]] = part.records
    assert records is not None
    # one layer of the parts' kind over the stacked records (no re-quantization)
    return kind.from_records(records, n, k, bias)


def _layer(
    weight: Weight, start: int, stop: int, bias: torch.Tensor | None, mode: str, lowbit: bool
) -> nn.Module:
    """The quantized module of rows start..stop-1. Q4_K and Q6_K blocks become our q4k and q6k
    records as they are (loading/q4k.py, q6k.py: the file's own values, nothing rounded);
    every other weight is quantized from its float32 values."""
    table = weight if isinstance(weight, QuantizedTable) else None
    if lowbit and table is not None and NATIVE_TYPES.get(table.gguf_type) == mode:
        rows = table.data[start:stop]
        if table.gguf_type == "Q6_K":
            return Q6KLinear.from_groups(*q6k_groups(rows, table.cols), bias)
        return Q4KLinear.from_fields(*q4k_fields(rows, table.cols), bias)
    return quantize_weight(_rows(weight, start, stop), bias, mode, lowbit)


def _rows(weight: Weight, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop-1 of the weight in float32 (dequantized from a QuantizedTable)."""
    if isinstance(weight, QuantizedTable):
        return weight.rows(start, stop)
    return weight[start:stop]


class LinearConverter:
    """Takes the tensors of the linears in `modes` ("layers.0.attn.q" -> "int8") as they
    stream in and builds their quantized modules; `install` puts them into the model."""

    def __init__(self, model: nn.Module, modes: dict[str, str], lowbit: bool) -> None:
        self.modes, self.lowbit = modes, lowbit
        self.needs_bias = {name: model.get_submodule(name).bias is not None for name in modes}
        self.pending: dict[str, dict[str, Weight]] = {}
        self.built: dict[str, nn.Module] = {}

    def owns(self, name: str) -> bool:
        """Whether a tensor name ("layers.0.attn.q.weight") belongs to a converted linear."""
        owner, _, leaf = name.rpartition(".")
        return owner in self.modes and leaf in ("weight", "bias")

    def take(self, name: str, tensor: Weight) -> None:
        owner, _, leaf = name.rpartition(".")
        parts = self.pending.setdefault(owner, {})
        parts[leaf] = tensor
        if "weight" in parts and ("bias" in parts or not self.needs_bias[owner]):
            del self.pending[owner]
            bias = parts.get("bias")
            if isinstance(bias, QuantizedTable):
                raise SpecserveError(f"{owner}: a block-quantized bias")
            self.built[owner] = quantize_rows(parts["weight"], bias, self.modes[owner], self.lowbit)

    def install(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Swap the built modules in (a tied LM head is quantized from the embedding now,
        if it is a float table; loading/model.py passes a quantized one to `take` itself)."""
        if "lm_head" in self.modes and "lm_head" not in self.built and "embed.weight" in state:
            self.take("lm_head.weight", state["embed.weight"])
        missing = sorted(set(self.modes) - set(self.built))
        if missing:
            raise SpecserveError(f"weights missing for the linears {missing[:5]}")
        for name, module in self.built.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module)
        self.built = {}
