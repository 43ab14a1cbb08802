"""Real 0.5B in float32: a follow-up turn served from the prompt cache (its prefix computed
token by token while turn 1 was decoded) gives the tokens of a full prefill of the same
conversation. That holds only if a token's state does not depend on how many rows its
forward had: our low-bit kernels (auto, the server's default) and oneDNN's packed float32
linears (dequant) must both keep it."""

from __future__ import annotations

import pytest

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.loading.model import load_model

TURN1 = "Write a quicksort demo in C. Please, write just code. Do not write any extra comments."
TURN2 = "Now the same in Python."
N_TOKENS = 48


def _generate(engine: Engine, prompt: list[int], spec: bool) -> Request:
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS)
    (req,) = engine.generate([Request(prompt, params, SpecParams(n_max=8 if spec else 0))])
    return req


@pytest.mark.slow
@pytest.mark.parametrize(
    "weights", [pytest.param("auto", marks=pytest.mark.smoke), "dequant"], ids=str
)
def test_follow_up_from_the_cache_equals_a_full_prefill(
    weights: str, qwen05_path, real_threads
) -> None:  # noqa: ANN001
    from specserve.speculative.registry import build_speculator

    loaded = load_model(qwen05_path, "float32", weights=weights)
    tok = loaded.tokenizer
    assert tok is not None
    runner = ModelRunner(loaded.model, num_slots=2, max_len=512)
    engine = Engine(runner, build_speculator(["ngram-map-k", "suffix"]))
    turn1 = tok.chat([{"role": "user", "content": TURN1}])
    first = _generate(engine, turn1, spec=True)
    answer = {"role": "assistant", "content": tok.decode(first.output)}
    turn2 = tok.chat(
        [{"role": "user", "content": TURN1}, answer, {"role": "user", "content": TURN2}]
    )
    cached = _generate(engine, turn2, spec=True)
    # the reused prefix runs into the answer: tokens computed by decode and verify forwards
    assert cached.slot == first.slot and cached.timings.cache_n >= len(turn1) + N_TOKENS // 2
    fresh = _generate(Engine(ModelRunner(loaded.model, 1, 512), prompt_cache=False), turn2, False)
    assert fresh.timings.cache_n == 0
    assert cached.output == fresh.output
