"""GGUF Q4_K blocks become q4 records as they are: the same 4-bit values, the sub-block scale
and min as the records' float16 scale and low, no float32 round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specserve.loading.model import load_model
from specserve.loading.q4k import q4k_groups
from specserve.models.layers.lowbit import Q4Linear, half_values, int4_groups, pack_nibbles
from specserve.ops.cpu.build import problem
from tests.tiny import make_hf_model
from tests.tiny_gguf import gguf_blocks, write_gguf

needs_lowbit = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")


def _rows(rows: int = 16, cols: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(gguf_blocks(np.zeros((rows, cols), np.float32), "Q4_K", seed))


def _gguf_floats(data: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(data.numpy(), GGMLQuantizationType.Q4_K).copy())


def test_q4k_groups_are_the_ggufs_own_values() -> None:
    data = _rows()
    q, scale, low = q4k_groups(data, 512)
    assert q.shape == (16, 512) and scale.shape == low.shape == (16, 16)
    assert q.min() >= 0 and q.max() <= 15
    w = (q.view(16, -1, 32).float() * scale[..., None] + low[..., None]).view(16, 512)
    # the same float32 operations as the gguf package's dequantization: the same bits
    assert torch.equal(w, _gguf_floats(data).view(16, 512))
    with pytest.raises(ValueError, match="not Q4_K rows of 256 weights"):
        q4k_groups(data, 256)


@needs_lowbit
def test_the_records_keep_q_and_round_only_the_scales() -> None:
    data = _rows(seed=3)
    want = _gguf_floats(data).view(16, 512)
    layer = Q4Linear.from_groups(*q4k_groups(data, 512), None)
    packed, scale, low = layer.blocks()
    q, s, lo = q4k_groups(data, 512)
    assert torch.equal(packed, pack_nibbles(q))
    assert torch.equal(scale, half_values(s)) and torch.equal(low, half_values(lo))
    native = (q.view(16, -1, 32).float() * scale[..., None] + low[..., None]).view(16, 512)
    # min/max requantization of the same floats, the path before: far further off
    rq, rs, rl = int4_groups(want)
    requant = (rq.view(16, -1, 32).float() * rs[..., None] + rl[..., None]).view(16, 512)
    native_err, requant_err = (native - want).abs().max(), (requant - want).abs().max()
    assert native_err <= want.abs().max() * 2**-10
    assert native_err * 20 < requant_err


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
        assert isinstance(got, Q4Linear)  # v and up are float32 in the file: not fused
        packed, scale, low = got.blocks()
        n = want.shape[0]
        q = torch.cat([packed.view(n, -1, 16) & 15, packed.view(n, -1, 16) >> 4], -1)
        back = (q.float() * scale[..., None] + low[..., None]).view_as(want)
        assert (back - want).abs().max() <= want.abs().max() * 2**-10
