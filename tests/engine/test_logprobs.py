"""Logprobs: the raw distribution of the row that decided each token, top n by id on ties."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.logprobs import TokenLogprob, token_logprobs
from specserve.engine.request import Request
from specserve.engine.runner import ModelRunner, SlotInput
from specserve.engine.sampling import SamplingParams
from specserve.loading.model import load_model
from tests.tiny import VOCAB, write_hf_folder


def test_token_logprobs_match_log_softmax_with_ties_by_id() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 50, generator=g, dtype=torch.float64)
    rows[1, [4, 9, 30]] = 7.0  # a three-way tie at the top of row 1
    got = token_logprobs(rows, [3, 30, 0], 2)
    ref = torch.log_softmax(rows, dim=-1)
    assert [e.token for e in got] == [3, 30, 0]
    want = [ref[0, 3].item(), ref[1, 30].item(), ref[2, 0].item()]
    assert [e.logprob for e in got] == pytest.approx(want, abs=1e-14)
    assert [t for t, _ in got[1].top] == [4, 9]  # the tie at the top, the lower ids first
    for i, e in enumerate(got):
        values, ids = ref[i].topk(2)
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-14)
        if i != 1:
            assert [t for t, _ in e.top] == ids.tolist()
    assert token_logprobs(rows.float(), [5], 0) == [
        TokenLogprob(5, pytest.approx(ref[0, 5].item(), abs=1e-5))  # type: ignore[arg-type]
    ]


def test_top_logprobs_beyond_the_limit_are_refused() -> None:
    with pytest.raises(ValueError, match="top logprobs must be in"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="top logprobs must be in"):
        token_logprobs(torch.zeros(1, 8), [0], -1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):  # noqa: ANN001, ANN201
    folder = tmp_path_factory.mktemp("qwen2")
    write_hf_folder("qwen2", folder, seed=4)
    return load_model(folder, dtype="float64").model


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=0), dict(temperature=0.7, seed=3, repetition_penalty=1.3, top_k=4)],
    ids=["greedy", "sampled-penalised"],
)
def test_engine_reports_the_models_own_distribution(model, settings: dict) -> None:  # noqa: ANN001
    """Whatever the sampling settings, a token's logprobs are log_softmax of the model's
    logits at its position: one forward over prompt + output gives them all."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    req = Request(prompt, SamplingParams(max_tokens=12, logprobs=3, **settings))
    Engine(ModelRunner(model, num_slots=1, max_len=64)).generate([req])
    seq = prompt + req.output
    runner = ModelRunner(model, num_slots=1, max_len=64)
    (logits,) = runner.forward([SlotInput(0, seq[:-1], n_logits=len(req.output))])
    ref = torch.log_softmax(logits, dim=-1)
    assert [e.token for e in req.logprobs] == req.output
    for i, e in enumerate(req.logprobs):
        assert e.logprob == pytest.approx(ref[i, e.token].item(), abs=1e-12)
        values, ids = ref[i].topk(3)
        assert [t for t, _ in e.top] == ids.tolist()
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-12)
    if settings["temperature"] == 0:
        assert all(e.top[0][0] == e.token for e in req.logprobs)
    else:  # the penalised, sampled tokens are not all the model's favourites
        assert any(e.top[0][0] != e.token for e in req.logprobs)


def test_no_logprobs_unless_asked(model) -> None:  # noqa: ANN001
    req = Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    Engine(ModelRunner(model, num_slots=1, max_len=64)).generate([req])
    assert len(req.output) == 4 and req.logprobs == []
