"""GGUF Q6_K blocks become q6k records as they are: the same 6-bit values, sub-scales and d,
nothing rounded, no float32 round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specserve.loading.model import load_model
from specserve.loading.q6k import q6k_groups
from specserve.models.layers.lowbit import Q6KLinear
from specserve.models.layers.lowbit_fused import FusedLowbit
from specserve.ops.cpu.build import problem
from tests.loading.test_q4k import _file_floats, computes_with
from tests.models.lowbit_cases import record_values
from tests.tiny import make_hf_model
from tests.tiny_gguf import gguf_blocks, write_gguf

needs_lowbit = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")


def _rows(rows: int = 16, cols: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(gguf_blocks(np.zeros((rows, cols), np.float32), "Q6_K", seed))


def _gguf_floats(data: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(data.numpy(), GGMLQuantizationType.Q6_K).copy())


def _values(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """w = (d * sc) * (q - 32) in float32, the gguf package's order of operations."""
    n, k = q.shape
    step = d.repeat_interleave(2, dim=1) * sc.float()  # [N, K/16]
    return (step[..., None] * (q.float() - 32).view(n, -1, 16)).view(n, k)


def test_q6k_groups_are_the_ggufs_own_values() -> None:
    data = _rows()
    q, d, sc = q6k_groups(data, 512)
    assert q.shape == (16, 512) and d.shape == (16, 16) and sc.shape == (16, 32)
    assert q.min() >= 0 and q.max() == 63 and sc.dtype == torch.int8
    # every value and sub-scale of random blocks is used: all 64 levels, negative scales
    assert len(q.unique()) == 64 and (sc < 0).any()
    assert torch.equal(_values(q, d, sc), _gguf_floats(data).view(16, 512))
    with pytest.raises(ValueError, match="not Q6_K rows of 256 weights"):
        q6k_groups(data, 256)


@needs_lowbit
def test_the_records_hold_the_blocks_unrounded() -> None:
    data = _rows(rows=20, seed=3)  # 20 outputs: a padded last tile
    groups = q6k_groups(data, 512)
    layer = Q6KLinear.from_groups(*groups, None)
    for got, want in zip(record_values(layer), groups, strict=True):
        assert torch.equal(got, want)
    computes_with(layer, _gguf_floats(data).view(20, 512))


@needs_lowbit
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_q6_k_linears_load_as_their_own_blocks(arch: str, tmp_path: Path) -> None:
    # llama's q/k rows are permuted in the file: the blocks' rows move back as float rows do
    hf = make_hf_model(arch, seed=5, hidden_size=256, intermediate_size=512)
    names = ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.1.attn_v.weight")
    path = write_gguf(hf, arch, tmp_path / "m.gguf", dict.fromkeys(names, "Q6_K"))
    floats = load_model(path, "float32", with_tokenizer=False, prepack=False).model
    native = load_model(path, "float32", with_tokenizer=False, weights="auto").model
    got = [native.layers[0].attn.q, native.layers[0].mlp.down, native.layers[1].attn.v]
    dequant = [floats.layers[0].attn.q, floats.layers[0].mlp.down, floats.layers[1].attn.v]
    for name, layer, ref in zip(names, got, dequant, strict=True):
        want = _file_floats(path, name, arch, hf.config.num_attention_heads)
        assert torch.equal(ref.weight.detach(), want)  # the float path, blocks streamed
        assert isinstance(layer, Q6KLinear), name  # float32 neighbours: not fused
        assert torch.equal(_values(*record_values(layer)), want), name  # the file's own weights
    assert not any(isinstance(m, FusedLowbit) for m in native.layers[0].attn.modules())
