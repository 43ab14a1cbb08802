"""`prediction` (OpenAI's Predicted Outputs): drafts from the text the client expects back."""

from __future__ import annotations

import pytest

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.speculative.base import DraftRequest
from specserve.speculative.prediction import MAX_MATCH, PredictionSpeculator
from specserve.speculative.registry import build_speculator
from tests.speculative.drive import distinct_tokens, random_tokens
from tests.tiny import VOCAB

PROMPT = distinct_tokens(1, 20)
PREDICTED = distinct_tokens(2, 30)


def ask(spec: PredictionSpeculator, output: list[int], n_max: int = 4) -> list[int]:
    req = DraftRequest(0, PROMPT + output, n_max, prediction=PREDICTED)
    return spec.draft([req])[0].tokens


def test_follows_the_prediction_and_resumes_after_an_edit() -> None:
    spec = PredictionSpeculator()
    spec.begin(0, PROMPT)
    assert ask(spec, PREDICTED[:1]) == PREDICTED[1:5]
    spec.accept(0, 4)  # all kept, then the target's own token continued the prediction
    assert ask(spec, PREDICTED[:6]) == PREDICTED[6:10]
    spec.accept(0, 1)  # one kept, then an edit: two tokens the prediction does not have
    edited = [*PREDICTED[:7], 7, 8]
    assert ask(spec, edited) == []
    # the output rejoins the prediction further on: drafting resumes after that point
    assert ask(spec, [*edited, *PREDICTED[15:17]]) == PREDICTED[17:21]


def test_realigns_on_the_longest_then_nearest_match() -> None:
    spec = PredictionSpeculator()
    spec.begin(0, PROMPT)
    a, b, c = PREDICTED[:3]
    predicted = [a, b, 50, c, 60, a, b, c, 70, c, 80]
    req = DraftRequest(0, [*PROMPT, 99, a, b, c], 2, prediction=predicted)
    d = spec.draft([req])[0]
    assert d.tokens == [70, c] and d.tier == 3  # "a b c" beats the nearer "c"


def test_no_prediction_no_draft_and_a_run_ends_with_the_prediction() -> None:
    spec = PredictionSpeculator()
    spec.begin(0, PROMPT)
    assert spec.draft([DraftRequest(0, [*PROMPT, 5], 4)])[0].tokens == []
    assert ask(spec, PREDICTED, 4) == []  # nothing predicted after the end
    assert MAX_MATCH >= 2


N_TOKENS = 96


def _run(model, types: str | None, prompts: list[list[int]], predictions: list[list[int]]):  # noqa: ANN001, ANN202
    spec = build_speculator(types.split(",")) if types else None
    engine = Engine(ModelRunner(model, num_slots=len(prompts), max_len=256), spec)
    reqs = [
        Request(p, SamplingParams(temperature=0, max_tokens=N_TOKENS), SpecParams(n_max=16))
        for p in prompts
    ]
    for req, predicted in zip(reqs, predictions, strict=True):
        req.prediction = predicted
    engine.generate(reqs)
    return [r.output for r in reqs], spec


@pytest.mark.parametrize("types", ["prediction", "ngram-map-k,suffix,prediction"])
def test_output_is_the_targets_whatever_the_prediction(target, types: str) -> None:  # noqa: ANN001
    prompts = [random_tokens(s, 40, VOCAB) for s in (3, 4, 5)]
    reference, _ = _run(target, None, prompts, [[], [], []])
    edited = [*reference[0][:30], 1, 2, 3, *reference[0][40:]]  # an edit mid-way
    unrelated = random_tokens(9, 80, VOCAB)
    predictions = [edited, unrelated, reference[2]]
    out, spec = _run(target, types, prompts, predictions)
    assert out == reference
    assert spec is not None and spec.stats.tokens_accepted > N_TOKENS  # most of 0 and 2


def _realign_reference(predicted: list[int], recent: list[int], after: int) -> tuple[int, int]:
    """The readable rule: every occurrence of the last token, its match length by walking
    back; the longest wins, then the first at or after `after`, else the first."""
    if not recent:
        return 0, 0
    found = []
    for end, token in enumerate(predicted):
        if token != recent[-1]:
            continue
        n = 1
        while n < len(recent) and end - n >= 0 and predicted[end - n] == recent[-1 - n]:
            n += 1
        found.append((n, end))
    if not found:
        return 0, 0
    best_len = max(n for n, _ in found)
    ends = [end for n, end in found if n == best_len]
    later = [end for end in ends if end + 1 >= after]
    return (later or ends)[0] + 1, best_len


@pytest.mark.parametrize("seed", range(40))
def test_vectorised_realignment_equals_the_readable_rule(seed: int) -> None:
    import random

    import numpy as np

    from specserve.speculative.prediction import _realign

    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5])  # few distinct tokens: many occurrences and ties
    predicted = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
    recent = [rng.randrange(vocab) for _ in range(rng.randrange(0, MAX_MATCH + 1))]
    after = rng.randrange(0, 70)
    got = _realign(np.asarray(predicted, dtype=np.int64), recent, after)
    assert got == _realign_reference(predicted, recent, after)


def test_step_outputs_name_the_drafter_of_their_accepted_tokens(target) -> None:  # noqa: ANN001
    """Each step says how many of its tokens, from the first, were accepted drafts and whose:
    in a chain, the prediction's where the request sent one, n-grams' or suffixes' where
    it did not; a step cut short by max_tokens counts only the drafts it kept."""
    prompts = [random_tokens(s, 40, VOCAB) for s in (3, 4)]
    reference, _ = _run(target, None, prompts, [[], []])
    spec = build_speculator(["ngram-map-k", "suffix", "prediction"])
    engine = Engine(ModelRunner(target, num_slots=2, max_len=256), spec)
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS)
    reqs = [Request(p, params, SpecParams(n_max=16)) for p in prompts]
    reqs[0].prediction = reference[0]
    for req in reqs:
        engine.add_request(req)
    drafted: dict[int, list[tuple[int, str]]] = {r.id: [] for r in reqs}
    while engine.has_work():
        for out in engine.step():
            assert 0 <= out.drafted <= len(out.tokens) and bool(out.drafted) == bool(out.drafted_by)
            drafted[out.request.id].append((out.drafted, out.drafted_by))
    predicted, alone = (drafted[r.id] for r in reqs)
    assert {by for n, by in predicted if n} == {"prediction"}
    others = {by for n, by in alone if n}
    assert others and others <= {"ngram-map-k", "suffix"}
    for req, steps in zip(reqs, (predicted, alone), strict=True):
        kept = sum(n for n, _ in steps)
        assert kept <= req.timings.draft_n_accepted <= kept + 16
    assert sum(n for n, _ in predicted) > N_TOKENS // 2
