"""GGUF in llama.cpp's layout (as convert_hf_to_gguf.py writes Qwen3-Next / Qwen3.5) loads to
the very tensors the HF folder loads to: interleaved qkvz/ba, tiled value heads, -exp(A_log),
+1 norms, stacked experts and Qwen3.5's MTP block appended as `nextn` all undone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.loading.model import load_model
from tests.tiny_gguf_hybrid import write_hybrid_gguf
from tests.tiny_hybrid import HYBRID_ARCHS, make_hybrid_model, mtp_tensors


def _float32_exact(name: str, t: torch.Tensor) -> torch.Tensor:
    """GGUF holds float32: round every weight to it, except A_log, which the tiny models
    make the log of a float32 number so llama.cpp's -exp(A_log) round-trips exactly."""
    return t if name.endswith("A_log") else t.float().double()


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_gguf_loads_the_same_tensors_as_hf(arch: str, tmp_path) -> None:  # noqa: ANN001
    hf = make_hybrid_model(arch, seed=4)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(_float32_exact(name, p))
    mtp = {k: _float32_exact(k, t) for k, t in mtp_tensors(hf, seed=5).items()}
    hf.save_pretrained(str(tmp_path))
    path = tmp_path / "model.safetensors"
    save_file({**load_file(str(path)), **mtp}, str(path), {"format": "pt"})
    gguf = write_hybrid_gguf(hf, arch, tmp_path / "tiny.gguf", mtp)

    from_hf = load_model(tmp_path, dtype="float64", with_tokenizer=False).model
    from_gguf = load_model(gguf, dtype="float64", with_tokenizer=False).model
    # llama.cpp keeps MTP layers for Qwen3.5 only (its Qwen3-Next converter drops them)
    mtp_kept = arch == "qwen3_5"
    assert from_gguf.cfg == replace(from_hf.cfg, mtp_layers=1 if mtp_kept else 0)
    ours, theirs = from_hf.state_dict(), from_gguf.state_dict()
    assert set(theirs) == {k for k in ours if mtp_kept or not k.startswith("mtp.")}
    for name, t in theirs.items():
        assert torch.equal(t, ours[name]), name
