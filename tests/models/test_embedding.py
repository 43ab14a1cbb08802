"""QuantizedEmbedding: the rows of a GGUF table, dequantized as looked up, are bit for bit
the rows of the whole table dequantized (what the loader held before), in any dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.models.layers.embedding import (
    QuantizedEmbedding,
    QuantizedTable,
    is_quantized,
    rows_dtype_device,
)
from tests.tiny_gguf import gguf_blocks

ROWS, COLS = 50, 512  # 512: two super-blocks of 256 per row for the K types


def _table(qtype: str) -> QuantizedTable:
    floats = np.random.default_rng(3).normal(0, 0.05, (ROWS, COLS)).astype(np.float32)
    return QuantizedTable(torch.from_numpy(gguf_blocks(floats, qtype, seed=7)), qtype, COLS)


def _whole(table: QuantizedTable) -> torch.Tensor:
    """The whole table through gguf.quants.dequantize in one call, as loading/gguf.py reads it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    array = dequantize(table.data.numpy(), GGMLQuantizationType[table.gguf_type])
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare bit patterns (equal NaNs, and -0.0 != 0.0)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_looked_up_rows_equal_the_dequantized_table_bit_for_bit(qtype: str) -> None:
    table = _table(qtype)
    whole = _whole(table)
    assert whole.shape == (ROWS, COLS) and torch.isfinite(whole).all()
    assert whole.abs().max() > 0  # a real table, not zeros
    embed = QuantizedEmbedding(table)
    ids = torch.tensor([[3, 0, 49], [3, 17, 17]])  # repeats, first and last rows, 2-D ids
    assert torch.equal(_bits(embed(ids)), _bits(whole[ids]))
    assert torch.equal(_bits(embed(torch.arange(ROWS))), _bits(whole))
    assert embed(torch.tensor([], dtype=torch.long)).shape == (0, COLS)
    # table ranges (what a tied head is quantized from) are the same rows too
    assert torch.equal(_bits(table.rows(8, 24)), _bits(whole[8:24]))
    assert torch.equal(_bits(table.dequantize()), _bits(whole))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_rows_are_cast_as_the_float_table_was(dtype: torch.dtype) -> None:
    table = _table("Q5_0")
    embed = QuantizedEmbedding(table, dtype)
    ids = torch.tensor([5, 1, 5, 40])
    got = embed(ids)
    assert got.dtype == dtype
    assert torch.equal(_bits(got), _bits(_whole(table).to(dtype)[ids]))
    assert rows_dtype_device(embed) == (dtype, torch.device("cpu"))


def test_the_module_holds_blocks_not_floats() -> None:
    table = _table("Q8_0")
    embed = QuantizedEmbedding(table)
    assert [n for n, _ in embed.named_buffers()] == ["raw"]
    assert not list(embed.parameters())
    assert embed.raw.dtype == torch.uint8 and embed.raw.shape == (ROWS, COLS // 32 * 34)
    assert (embed.num_embeddings, embed.embedding_dim) == (ROWS, COLS)


def test_float_types_are_not_quantized() -> None:
    assert not any(is_quantized(t) for t in ("F32", "F16", "BF16"))
    assert all(is_quantized(t) for t in ("Q4_K", "Q5_0", "Q6_K", "Q8_0", "IQ4_NL"))


def test_kept_rows_of_small_lookups_are_the_table_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from specserve.models.layers import embedding

    monkeypatch.setattr(embedding, "ROW_CACHE", 4)
    table = _table("Q5_0")
    whole = _whole(table).to(torch.bfloat16)
    embed = QuantizedEmbedding(table, torch.bfloat16)
    rng = np.random.default_rng(0)
    for _ in range(40):  # decode-sized lookups that hit, miss and evict kept rows
        ids = torch.from_numpy(rng.integers(0, 8, size=int(rng.integers(1, 4))))
        assert torch.equal(_bits(embed(ids)), _bits(whole[ids]))
    assert 0 < len(embed._rows) <= 4
    big = torch.arange(ROWS)  # a prompt's lookup goes straight through
    assert torch.equal(_bits(embed(big)), _bits(whole))
