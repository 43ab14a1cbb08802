"""`n` choices through the real openai client (tiny float64 model): choice i is the lone
request with seed s + i, the prompt is prefilled once, usage counts it once, a stream
reassembles per index into the whole response, and a client gone aborts every choice."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from specserve.loading.model import LoadedModel
from tests.server.conftest import MODEL_ID, LiveServer, chat_text, start_server
from tests.server.test_openai_api import ABORTED, client, metrics, wait_until_idle

SEED = 21
MESSAGES = [{"role": "user", "content": "tell me a story"}]
NO_CACHE = {"cache_prompt": False}  # every request prefills: prompt_n is what it computed


@pytest.fixture(scope="module")
def one_slot(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    """One slot, speculating: a request's other choices wait for it."""
    server = start_server(tiny_model, parallel=1, spec_types=("ngram-map-k", "suffix"))
    yield server
    server.stop()


@pytest.fixture(params=["live", "drafting", "one_slot"])
def server(request: pytest.FixtureRequest) -> LiveServer:
    """4 slots without speculation, 2 slots with, 1 slot with."""
    return request.getfixturevalue(request.param)


def _chat(server: LiveServer, **kw: Any) -> Any:
    args = dict(model=MODEL_ID, messages=MESSAGES, max_tokens=24, temperature=1.0)
    return client(server).chat.completions.create(**{**args, **kw}, extra_body=NO_CACHE)


def _complete(server: LiveServer, **kw: Any) -> Any:
    args = dict(model=MODEL_ID, prompt=chat_text(MESSAGES), max_tokens=24, temperature=1.0)
    return client(server).completions.create(**{"extra_body": NO_CACHE, **args, **kw})


def test_chat_choices_equal_lone_requests_and_count_the_prompt_once(server: LiveServer) -> None:
    got = _chat(server, n=3, seed=SEED)
    lone = [_chat(server, seed=SEED + i) for i in range(3)]
    assert [c.index for c in got.choices] == [0, 1, 2]
    texts = [c.message.content for c in got.choices]
    assert texts == [r.choices[0].message.content for r in lone]
    assert [c.finish_reason for c in got.choices] == [r.choices[0].finish_reason for r in lone]
    assert len(set(texts)) == 3  # the seeds make them differ
    prompt = lone[0].usage.prompt_tokens
    assert got.usage.prompt_tokens == prompt
    assert got.usage.completion_tokens == sum(r.usage.completion_tokens for r in lone)
    assert got.usage.total_tokens == prompt + got.usage.completion_tokens
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    # prefilled once: the other two choices found the whole prompt in their slots
    assert got.timings["prompt_n"] == prompt
    assert got.timings["cache_n"] == 2 * prompt
    assert got.timings["predicted_n"] == sum(r.timings["predicted_n"] for r in lone)


def test_completion_choices_equal_lone_requests(server: LiveServer) -> None:
    got = _complete(server, n=3, seed=SEED, echo=True)
    lone = [_complete(server, seed=SEED + i, echo=True) for i in range(3)]
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [r.choices[0].text for r in lone]
    assert all(c.text.startswith(chat_text(MESSAGES)) for c in got.choices)
    assert got.usage.completion_tokens == sum(r.usage.completion_tokens for r in lone)
    assert got.timings["prompt_n"] == got.usage.prompt_tokens


def test_streamed_chat_choices_reassemble_into_the_whole_response(server: LiveServer) -> None:
    whole = _chat(server, n=3, seed=SEED)
    chunks = list(
        _chat(server, n=3, seed=SEED, stream=True, stream_options={"include_usage": True})
    )
    texts, reasons, roles = ["", "", ""], [None] * 3, [None] * 3
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice per chunk, named by its index
        i = choice.index
        roles[i] = roles[i] or choice.delta.role
        texts[i] += choice.delta.content or ""
        reasons[i] = choice.finish_reason or reasons[i]
    assert roles == ["assistant"] * 3
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_streamed_completion_choices_reassemble_into_the_whole_response(server: LiveServer) -> None:
    whole = _complete(server, n=3, seed=SEED)
    texts = ["", "", ""]
    for chunk in _complete(server, n=3, seed=SEED, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]


def test_each_choice_follows_the_grammar_on_its_own(drafting: LiveServer) -> None:
    """Each choice has its own grammar state: three different texts, each the lone one."""
    regex = {"guided_regex": r"id-[0-9]{3}: (ok|late|gone)"}
    got = _complete(drafting, n=3, seed=SEED, extra_body={**NO_CACHE, **regex})
    lone = [_complete(drafting, seed=SEED + i, extra_body={**NO_CACHE, **regex}) for i in range(3)]
    texts = [c.text for c in got.choices]
    assert texts == [r.choices[0].text for r in lone]
    assert all(re.fullmatch(regex["guided_regex"], t) for t in texts) and len(set(texts)) > 1


def test_greedy_choices_are_one_text(live: LiveServer) -> None:
    got = _chat(live, n=3, temperature=0)
    assert len({c.message.content for c in got.choices}) == 1


def test_choices_without_a_seed_each_draw_their_own(live: LiveServer) -> None:
    got = _chat(live, n=3)
    assert len({c.message.content for c in got.choices}) == 3


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "whole"])
@pytest.mark.parametrize("name", ["live", "one_slot"])
def test_a_client_gone_aborts_every_choice(
    name: str, stream: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Running in three slots, or one running and two waiting for the slot."""
    server: LiveServer = request.getfixturevalue(name)
    wait_until_idle(server)
    runner = server.loop.engine.runner
    forward = runner.forward

    def slow(work: Any) -> Any:  # no choice can end before the client has gone
        time.sleep(0.01)
        return forward(work)

    monkeypatch.setattr(runner, "forward", slow)
    before = metrics(server)[ABORTED]
    body = {"prompt": "hello", "max_tokens": 400, "temperature": 0, "n": 3}
    body["speculative"] = {"types": []}  # a token per forward
    if stream:
        with httpx2.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}):
            pass  # hang up once the response has started
    else:
        with pytest.raises(httpx2.TimeoutException):
            httpx2.post(server.url + "/v1/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 10
    while metrics(server)[ABORTED] < before + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metrics(server)[ABORTED] == before + 3
    assert not any(s["is_processing"] for s in wait_until_idle(server))
    assert server.loop.status.waiting == 0
