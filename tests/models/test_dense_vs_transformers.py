"""Our dense family equals transformers' implementation of the same architecture (float64)."""

from __future__ import annotations

import pytest
import torch

from specserve.batch import FlatBatch
from specserve.loading.model import load_model
from tests.tiny import VOCAB, write_hf_folder

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(autouse=True)
def _reference_norms_in_input_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' RMSNorms compute in float32 even for float64 models; the reference keeps
    the input dtype here so the comparison can be exact (the math is unchanged)."""
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    def rms(self, x):  # noqa: ANN001, ANN202
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    def plain(self, x):  # noqa: ANN001, ANN202
        return self.weight * rms(self, x)

    def gemma(self, x):  # noqa: ANN001, ANN202
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    monkeypatch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", gemma)
    for cls in (
        modeling_llama.LlamaRMSNorm,
        modeling_qwen2.Qwen2RMSNorm,
        modeling_qwen3.Qwen3RMSNorm,
    ):
        monkeypatch.setattr(cls, "forward", plain)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_transformers(arch: str, tmp_path) -> None:  # noqa: ANN001
    hf = write_hf_folder(arch, tmp_path)
    ours = load_model(tmp_path, dtype="float64").model
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (20,))
    cache = ours.new_cache(num_slots=1, max_len=64)
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0]
        got = ours.logits(ours(prompt, FlatBatch.build([0], [0], [20], prompt.device), cache))
        assert (got - ref).abs().max().item() < 1e-9
        # incremental decoding: one token at a time after the prompt
        seq = prompt
        for step in range(6):
            nxt = torch.randint(0, VOCAB, (1,))
            seq = torch.cat([seq, nxt])
            ref = hf(seq[None]).logits[0, -1]
            batch = FlatBatch.build([0], [20 + step], [1], prompt.device)
            got = ours.logits(ours(nxt, batch, cache))[0]
            assert (got - ref).abs().max().item() < 1e-9, f"decode step {step}"
