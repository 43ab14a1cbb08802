"""GGUF path: a tiny model written in llama.cpp's layout loads to the same logits as the HF one."""

from __future__ import annotations

import pytest
import torch

from specserve.batch import FlatBatch
from specserve.loading.model import load_model
from tests.models.test_dense_vs_transformers import _reference_norms_in_input_dtype  # noqa: F401
from tests.tiny import VOCAB, make_hf_model
from tests.tiny_gguf import write_gguf

# llama.cpp derives gemma3's softmax scale from head_dim and its layer pattern (5 local :
# 1 global) from the architecture, so the tiny gemma here follows those conventions.
GEMMA_AS_LLAMA_CPP = {"num_hidden_layers": 6, "query_pre_attn_scalar": 32, "layer_types": None}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_gguf_logits_match_transformers(arch: str, tmp_path) -> None:  # noqa: ANN001
    hf = make_hf_model(arch, seed=5, **(GEMMA_AS_LLAMA_CPP if arch == "gemma3" else {}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # GGUF holds float32; norms on a 2^-16 grid so gemma's 1 + w is exact in float32
            grid = 2.0**16 if name.endswith("norm.weight") else None
            p.copy_(torch.round(p * grid) / grid if grid else p.float().double())
    path = write_gguf(hf, arch, tmp_path / f"{arch}.gguf")
    ours = load_model(path, dtype="float64", with_tokenizer=False).model
    assert ours.cfg.arch == arch
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0]
        cache = ours.new_cache(1, 64)
        got = ours.logits(ours(prompt, FlatBatch.build([0], [0], [40], prompt.device), cache))
    assert (got - ref).abs().max().item() < 1e-9
