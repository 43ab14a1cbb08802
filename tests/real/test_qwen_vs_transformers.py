"""Real Qwen2.5-Coder-0.5B from its GGUF: our greedy tokens equal transformers' (float32)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams

PROMPTS = [
    pytest.param("Write a quicksort function in C.", 64, marks=pytest.mark.smoke, id="quicksort-c"),
    pytest.param("Explain what a mutex is in two sentences.", 64, id="mutex-prose"),
    pytest.param(
        "Write a Python class for a stack with push, pop and peek.", 64, id="stack-python"
    ),
]


@pytest.fixture(scope="module")
def hf_model(qwen05_path):  # noqa: ANN001, ANN201
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(qwen05_path.parent), gguf_file=qwen05_path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # generate exactly n tokens, as ours does
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize(("prompt", "n_tokens"), PROMPTS)
def test_greedy_tokens_equal_transformers(
    prompt: str, n_tokens: int, qwen05_f32, hf_model, real_threads
) -> None:  # noqa: ANN001
    tok = qwen05_f32.tokenizer
    ids = tok.chat([{"role": "user", "content": prompt}])
    engine = Engine(ModelRunner(qwen05_f32.model, num_slots=1, max_len=512))
    req = Request(ids, SamplingParams(temperature=0, max_tokens=n_tokens), SpecParams(n_max=0))
    engine.generate([req])

    with torch.inference_mode():
        ref = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n_tokens, do_sample=False, eos_token_id=None
        )[0, len(ids) :].tolist()
    assert req.output == ref, (tok.decode(req.output), tok.decode(ref))
