"""GGUF Q4_K blocks become q4k records as they are: the same 4-bit values, 6-bit scales and
mins and float16 d and dmin, no float32 round trip (and, for q4 records, the same values with
d * sc and dmin * m rounded to float16)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specserve.loading.model import load_model
from specserve.loading.q4k import q4k_fields
from specserve.models.layers.lowbit import Q4KLinear
from specserve.ops.cpu.build import problem
from specserve.ops.naive.lowbit import int4_groups
from tests.models.lowbit_cases import record_values
from tests.tiny import make_hf_model
from tests.tiny_gguf import gguf_blocks, write_gguf

needs_lowbit = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")


def _rows(rows: int = 16, cols: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(gguf_blocks(np.zeros((rows, cols), np.float32), "Q4_K", seed))


def _gguf_floats(data: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(data.numpy(), GGMLQuantizationType.Q4_K).copy())


def computes_with(layer: torch.nn.Module, weights: torch.Tensor) -> None:
    """The layer's output is x @ weights^T but for x's int8 quantization per block (~0.5 %)."""
    x = torch.randn(3, weights.shape[1], generator=torch.Generator().manual_seed(0))
    exact = x.double() @ weights.double().T
    rel = (layer(x).double() - exact).norm() / exact.norm()
    assert rel < 0.01, rel


def _weights(fields: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """w = (d * sc) * q + -(dmin * m) per block of 32, in the gguf package's float32 steps."""
    q, sc, m, d, dmin = fields
    n = q.shape[0]
    scale = d.repeat_interleave(8, dim=1) * sc.float()
    low = -(dmin.repeat_interleave(8, dim=1) * m.float())
    return (q.float().view(n, -1, 32) * scale[..., None] + low[..., None]).view(n, -1)


def test_q4k_fields_are_the_ggufs_own_values() -> None:
    data = _rows()
    fields = q4k_fields(data, 512)
    q, sc, m, d, dmin = fields
    assert q.shape == (16, 512) and sc.shape == m.shape == (16, 16)
    assert d.shape == dmin.shape == (16, 2)
    assert q.min() >= 0 and q.max() == 15 and len(q.unique()) == 16
    assert sc.max() <= 63 and m.max() <= 63 and len(sc.unique()) > 32  # all 6 bits used
    # the same float32 operations as the gguf package's dequantization: the same bits
    assert torch.equal(_weights(fields), _gguf_floats(data).view(16, 512))
    with pytest.raises(ValueError, match="not Q4_K rows of 256 weights"):
        q4k_fields(data, 256)


@needs_lowbit
def test_q4k_records_hold_the_fields_and_compute_with_them() -> None:
    data = _rows(rows=20, seed=6)  # 20 outputs: a padded last tile
    fields = q4k_fields(data, 512)
    layer = Q4KLinear.from_fields(*fields, None)
    for got, want in zip(record_values(layer), fields, strict=True):
        assert torch.equal(got.float(), want.float())
    computes_with(layer, _gguf_floats(data).view(20, 512))
    # min/max requantization of the same floats (the path before q4 took Q4_K's values) is
    # off by a large share of a step
    want = _gguf_floats(data).view(20, 512)
    rq, rs, rl = int4_groups(want)
    requant = (rq.view(20, -1, 32).float() * rs[..., None] + rl[..., None]).view(20, 512)
    assert (requant - want).abs().max() > want.abs().max() * 2**-6


def _file_floats(path: Path, name: str, arch: str, heads: int) -> torch.Tensor:
    """The tensor straight from the file, dequantized, llama's q rows unpermuted: the
    reference both loading paths must reproduce."""
    import gguf

    from specserve.loading.gguf import unpermute_rope

    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
    return unpermute_rope(w, heads) if arch == "llama" and "attn_q" in name else w


@needs_lowbit
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_q4_k_linears_load_as_their_own_blocks(arch: str, tmp_path: Path) -> None:
    # llama's q/k rows are permuted in the file (rope halves interleaved): the blocks' rows
    # move back as the float rows do
    hf = make_hf_model(arch, seed=4, hidden_size=256, intermediate_size=512)
    names = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight")
    path = write_gguf(hf, arch, tmp_path / "m.gguf", dict.fromkeys(names, "Q4_K"))
    floats = load_model(path, "float32", with_tokenizer=False, prepack=False).model
    native = load_model(path, "float32", with_tokenizer=False, weights="auto").model
    layer0, float0 = native.layers[0], floats.layers[0]
    pairs = ((layer0.attn.q, float0.attn.q), (layer0.mlp.gate, float0.mlp.gate))
    for name, (got, dequant) in zip(names, pairs, strict=True):
        want = _file_floats(path, name, arch, hf.config.num_attention_heads)
        assert torch.equal(dequant.weight.detach(), want)  # the float path, blocks streamed
        assert isinstance(got, Q4KLinear)  # v and up are float32 in the file: not fused
        assert torch.equal(_weights(record_values(got)), want)  # the file's own weights, exactly
