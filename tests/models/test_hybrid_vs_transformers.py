"""Qwen3-Next and Qwen3.5 (hybrid Gated DeltaNet + gated attention) equal transformers'
implementations: logits of a 100-token prompt, then of incremental decoding after it.

float32: transformers runs the delta rule, its norms and the router softmax in float32
internally, so float32 is where the two can be compared closely. Our float32 CPU path sums
in other orders than torch's ops: RMSNorm, rotary and attention on ops/cpu kernels
(pointwise.cpp, attention.cpp), and with oneDNN's pre-packed weights (the CPU default) the
GEMMs too. Those are rounding differences of ~1e-7 per op; over the layers the logits
differ by a few 1e-5, how many depending on the CPU's GEMM kernels (docs/perf/quality.md):
atol 5e-5 either way."""

from __future__ import annotations

import pytest
import torch

from specserve.batch import FlatBatch
from specserve.loading.model import load_model
from tests.tiny import VOCAB
from tests.tiny_hybrid import HYBRID_ARCHS, write_hybrid_folder

PROMPT = 100
DECODE = 8
ATOL = {False: 5e-5, True: 5e-5}  # by prepack


@pytest.mark.parametrize("prepack", [False, True])
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_prefill_and_decode_logits_match_transformers(arch: str, prepack: bool, tmp_path) -> None:  # noqa: ANN001
    hf = write_hybrid_folder(arch, tmp_path, seed=3).float()
    ours = load_model(tmp_path, dtype="float32", with_tokenizer=False, prepack=prepack).model
    assert ours.cfg.arch == arch and ours.cfg.mtp_layers == 1
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=g)
    cache = ours.new_cache(num_slots=2, max_len=PROMPT + DECODE)
    with torch.no_grad():
        out = hf(prompt[None], use_cache=True)
        batch = FlatBatch.build([1], [0], [PROMPT], prompt.device)
        got = ours.logits(ours(prompt, batch, cache))
        assert (got - out.logits[0]).abs().max().item() < ATOL[prepack]
        past = out.past_key_values
        for step in range(DECODE):
            tok = torch.randint(0, VOCAB, (1,), generator=g)
            out = hf(tok[None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            batch = FlatBatch.build([1], [PROMPT + step], [1], prompt.device)
            got = ours.logits(ours(tok, batch, cache))[0]
            err = (got - out.logits[0, -1]).abs().max().item()
            assert err < ATOL[prepack], f"decode step {step}: {err:.2e}"
