"""JSON mode in the engine: the allowed token of highest logit, restricted sampling, the end
token only after a whole object; on the tiny model, outputs that are JSON prefixes."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.json_grammar import START, advance
from specserve.engine.request import Request
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams, sample
from specserve.loading.model import load_model
from specserve.speculative.verify import pick_greedy, pick_sampled
from tests.tiny import CHAR_END, json_mode, write_hf_folder


def test_greedy_takes_the_best_allowed_token_ties_by_id() -> None:
    row = torch.tensor([0.0, 5.0, 3.0, 5.0, 3.0, 1.0])
    assert pick_greedy(row, lambda t: True) == 1
    assert pick_greedy(row, lambda t: t not in (1, 3)) == 2  # 2 and 4 tie: the lower id
    assert pick_greedy(row, lambda t: t == 5) == 5
    assert pick_greedy(row, lambda t: False) == 1  # nothing allowed: the argmax
    wide = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    want = max((v, -t) for t, v in enumerate(wide.tolist()) if t % 997 == 0)
    assert pick_greedy(wide, lambda t: t % 997 == 0) == -want[1]  # beyond the first 256


def test_sampled_is_the_distribution_restricted_to_allowed_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    logits = probs.log()
    draws = Counter(pick_sampled(probs, lambda t: t != 0, 7, pos, logits) for pos in range(6000))
    assert draws[0] == 0
    assert draws[1] / 6000 == pytest.approx(0.6, abs=0.025)
    # an allowed first draw is the unconstrained sample of that position
    plain = sample(probs.expand(200, 3), [7] * 200, list(range(200))).tolist()
    for pos, token in enumerate(plain):
        if token != 0:
            assert pick_sampled(probs, lambda t: t != 0, 7, pos, logits) == token
    assert pick_sampled(probs, lambda t: t == 9, 7, 0, logits) == 0  # none: greedy fallback


def test_the_end_token_only_closes_a_whole_object() -> None:
    c = json_mode()
    assert c.after(START, CHAR_END) is None
    assert c.after(START, ord("{")) is not None and c.after(START, 5) is None
    c.feed([ord("{"), ord("}")])
    assert c.after(c.state, CHAR_END) == c.state and c.after(c.state, ord(" ")) is None


def test_allowed_after_a_prefix_is_the_walk_along_it_asked_in_any_order() -> None:
    c = json_mode()
    text = list(b'{"a": [1, 2], "b": "x"}')

    def walked(prefix: list[int]) -> list[bool]:
        state = c.state
        for token in prefix:  # a refused token leaves the state, as feed does
            state = c.after(state, token) or state
        return [c.after(state, t) is not None for t in range(128)]

    asks = [text[:0], text[:1], text[:6], text[:3], text[:9], [ord("{"), ord("x"), ord('"')]]
    closed = list(b'{"a": 1}')  # whole at the top, but not inside another object
    for prefix in [*asks, text, text[:2], closed]:
        allowed = c.allowed(prefix)
        assert [allowed(t) for t in range(128)] == walked(prefix), bytes(prefix)
    c.feed(text[:5])  # the output moves: prefixes count from its new state
    for prefix in (closed, text[5:8], text[5:6], []):
        allowed = c.allowed(prefix)
        assert [allowed(t) for t in range(128)] == walked(prefix), bytes(prefix)


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    write_hf_folder("qwen2", folder, seed=2)
    return load_model(folder, dtype="float64").model


def _generate(model, params: SamplingParams) -> Request:  # noqa: ANN001
    req = Request([40, 50, 60, 70], params, stop_ids=frozenset({CHAR_END}))
    req.constraint = json_mode()
    Engine(ModelRunner(model, num_slots=1, max_len=128)).generate([req])
    return req


@pytest.mark.parametrize(
    "settings", [dict(temperature=0), dict(temperature=0.8, seed=3)], ids=["greedy", "sampled"]
)
def test_outputs_stay_json(model, settings: dict) -> None:  # noqa: ANN001
    # "}" banned: the object runs to max_tokens, a JSON prefix all the way
    req = _generate(model, SamplingParams(max_tokens=60, logit_bias={ord("}"): -100}, **settings))
    text = bytes(req.output)
    assert len(text) == 60 and advance(START, text) is not None, text
    # the bias makes "}" the model's choice wherever it is allowed: "{}", then the end
    closed = _generate(model, SamplingParams(max_tokens=60, logit_bias={ord("}"): 30}, **settings))
    assert closed.output == [ord("{"), ord("}"), CHAR_END] and closed.finish_reason == "stop"
    assert json.loads(bytes(closed.output[:-1])) == {}
