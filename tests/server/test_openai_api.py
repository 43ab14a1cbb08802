"""The OpenAI-compatible server, driven by the real `openai` client (tiny float64 model).

Greedy decoding throughout: the text is then a function of the prompt alone, whichever
endpoint, streaming or not, and however many other clients share the engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx2
import openai
import pytest

from specserve.loading.model import LoadedModel
from tests.server.conftest import MODEL_ID, LiveServer, chat_text, start_server

HELLO = [{"role": "user", "content": "hello"}]


def client(server: LiveServer, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def complete(server: LiveServer, prompt: str, max_tokens: int = 24) -> str:
    out = client(server).completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


def chat_stream_text(server: LiveServer, messages: list, **kw: object) -> tuple[str, str | None]:
    stream = client(server).chat.completions.create(
        model=MODEL_ID, messages=messages, temperature=0, stream=True, **kw
    )
    parts, reason = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(parts), reason


def post(server: LiveServer, path: str, body: dict | bytes, **kw: object) -> httpx2.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return httpx2.post(server.url + path, content=body, headers=headers, timeout=30, **kw)
    return httpx2.post(server.url + path, json=body, timeout=30, **kw)


CHAT = "/v1/chat/completions"


def test_health_and_models(live: LiveServer) -> None:
    assert httpx2.get(live.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client(live).models.list()] == [MODEL_ID]


def test_every_endpoint_streaming_or_not_gives_the_same_text(live: LiveServer) -> None:
    c = client(live)
    chat = c.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=20, temperature=0)
    text = chat.choices[0].message.content
    assert text and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 20
    assert chat.timings["predicted_n"] == 20  # llama.cpp's timings ride along
    assert chat_stream_text(live, HELLO, max_tokens=20) == (text, "length")

    completion = c.completions.create(
        model=MODEL_ID, prompt=chat_text(HELLO), max_tokens=20, temperature=0
    )
    assert completion.choices[0].text == text
    streamed = c.completions.create(
        model=MODEL_ID, prompt=chat_text(HELLO), max_tokens=20, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == text

    response = c.responses.create(
        model=MODEL_ID, input="hello", max_output_tokens=20, temperature=0
    )
    assert response.output_text == text and response.status == "incomplete"
    events = list(
        c.responses.create(
            model=MODEL_ID, input="hello", max_output_tokens=20, temperature=0, stream=True
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == text


def test_stream_usage_chunk(live: LiveServer) -> None:
    stream = client(live).chat.completions.create(
        model=MODEL_ID,
        messages=HELLO,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = list(stream)[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5


def test_stop_string_cuts_the_text_streaming_or_not(live: LiveServer) -> None:
    full = complete(live, "Once upon a time", max_tokens=30)
    stop = full[8:10]
    expected = full[: full.index(stop)]
    c = client(live)
    kw = dict(model=MODEL_ID, prompt="Once upon a time", max_tokens=30, temperature=0, stop=[stop])
    out = c.completions.create(**kw)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
    streamed = list(c.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == expected


PROMPTS = ["hello", "The quick brown fox", "abc", "Once upon a time"]


def test_sequential_again_and_parallel_runs_agree(live: LiveServer) -> None:
    first = [complete(live, p) for p in PROMPTS]
    again = [complete(live, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        parallel = list(pool.map(lambda p: complete(live, p), PROMPTS))
    assert first == again == parallel
    assert len(set(first)) > 1  # the prompts lead to different texts


def test_greedy_alone_equals_while_three_clients_stream(live: LiveServer) -> None:
    alone = complete(live, PROMPTS[0], max_tokens=40)

    def busy(prompt: str) -> str:
        return chat_stream_text(live, [{"role": "user", "content": prompt}], max_tokens=200)[0]

    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(busy, p) for p in PROMPTS[1:]]
        time.sleep(0.05)  # let them take their slots
        loaded = complete(live, PROMPTS[0], max_tokens=40)
        assert not any(f.done() for f in others)  # it really ran alongside them
        assert all(len(f.result()) > 0 for f in others)
    assert loaded == alone


def test_follow_up_turn_reuses_the_cached_prefix(live: LiveServer) -> None:
    """Turn 2 re-sends turn 1: the slot that served it prefills only the new part, and the
    text equals a full prefill's (`cache_prompt: false`)."""
    c = client(live)
    first = c.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=12, temperature=0)
    answer = {"role": "assistant", "content": first.choices[0].message.content}
    turn = [*HELLO, answer, {"role": "user", "content": "more"}]
    kw = dict(model=MODEL_ID, messages=turn, max_tokens=12, temperature=0)
    second = c.chat.completions.create(**kw)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(chat_text(HELLO)) and second.timings["cache_n"] == cached
    assert second.timings["prompt_n"] == second.usage.prompt_tokens - cached
    full = c.chat.completions.create(**kw, extra_body={"cache_prompt": False})
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert full.choices[0].message.content == second.choices[0].message.content


def test_accepted_settings_that_change_nothing(live: LiveServer) -> None:
    """Plain text asked for in the fields that could ask for more: answered as without."""
    text = complete(live, chat_text(HELLO), 8)
    kw = dict(model=MODEL_ID, messages=HELLO, max_tokens=8, temperature=0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for extra in ({"response_format": {"type": "text"}}, {"tools": tools, "tool_choice": "none"}):
        got = client(live).chat.completions.create(**kw, **extra)  # type: ignore[arg-type]
        assert got.choices[0].message.content == text


def test_logit_bias_forces_and_bans_tokens(live: LiveServer) -> None:
    """The tiny tokenizer's ids are character codes: +100 on "z" makes every token "z";
    -100 on the plain output's first character keeps it out of the output."""
    prompt = chat_text(HELLO)
    plain = complete(live, prompt, 12)
    assert len(plain) == 12  # one character a token, none special
    kw = dict(model=MODEL_ID, prompt=prompt, max_tokens=12, temperature=0)
    forced = client(live).completions.create(**kw, logit_bias={str(ord("z")): 100})
    assert forced.choices[0].text == "z" * 12
    banned = plain[0]
    text = client(live).completions.create(**kw, logit_bias={str(ord(banned)): -100})
    assert banned not in text.choices[0].text and text.choices[0].text != plain


def test_echo_puts_the_prompt_first_streaming_or_not(live: LiveServer) -> None:
    prompt = chat_text(HELLO)
    plain = complete(live, prompt, 10)
    assert plain
    kw = dict(model=MODEL_ID, max_tokens=10, temperature=0, echo=True)
    whole = client(live).completions.create(prompt=prompt, **kw)
    assert whole.choices[0].text == prompt + plain
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    stream = client(live).completions.create(prompt=prompt, stream=True, **kw)
    assert "".join(c.choices[0].text for c in stream if c.choices) == prompt + plain
    ids = client(live).completions.create(prompt=[ord(c) for c in prompt], **kw)
    assert ids.choices[0].text == prompt + plain  # token ids: their decoded text


@pytest.fixture(scope="module")
def predicting(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    """Two slots; the prediction drafter alone, so every kept draft token is its."""
    server = start_server(tiny_model, parallel=2, spec_types=("prediction",))
    yield server
    server.stop()


def test_prediction_speeds_up_the_same_text(live: LiveServer, predicting: LiveServer) -> None:
    """OpenAI's Predicted Outputs: the answer expected back, with an edit, is a draft source;
    the text is the one without it (and without speculation), and drafts were kept."""
    kw = dict(model=MODEL_ID, messages=HELLO, max_tokens=60, temperature=0)
    plain = client(live).chat.completions.create(**kw).choices[0].message.content
    assert plain is not None and len(plain) > 40
    edited = plain[:20] + "#@!" + plain[25:]
    extra = {"prediction": {"type": "content", "content": edited}}
    got = client(predicting).chat.completions.create(**kw, extra_body=extra)
    assert got.choices[0].message.content == plain
    assert got.timings["draft_n_accepted"] >= 30  # type: ignore[attr-defined]
    # a server without the drafter takes the prediction as the hint it is
    got = client(live).chat.completions.create(**kw, extra_body=extra)
    assert got.choices[0].message.content == plain
    assert got.timings["draft_n"] == 0  # type: ignore[attr-defined]


def test_speculation_off_per_request_is_accepted(live: LiveServer) -> None:
    body = {"messages": HELLO, "max_tokens": 3, "temperature": 0, "speculative": {"types": []}}
    assert post(live, CHAT, body).status_code == 200


@pytest.fixture(scope="module")
def small(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    """One slot, no waiting room, an API key."""
    server = start_server(tiny_model, parallel=1, max_queue=0, api_key="sekret")
    yield server
    server.stop()


def test_api_key(small: LiveServer) -> None:
    body = {"messages": HELLO, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        got = post(small, CHAT, body, headers=headers)
        assert got.status_code == 401 and got.json()["error"]["code"] == "invalid_api_key"
    assert post(small, CHAT, body, headers={"Authorization": "Bearer sekret"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        client(small, "wrong").models.list()
    assert httpx2.get(small.url + "/health").status_code == 200  # probes need no key


def test_full_queue_is_503_with_retry_after(small: LiveServer) -> None:
    stream = client(small, "sekret").completions.create(
        model=MODEL_ID, prompt="hello", max_tokens=480, temperature=0, stream=True
    )
    try:
        next(iter(stream))  # the only slot is busy now
        got = post(small, CHAT, {"messages": HELLO}, headers={"Authorization": "Bearer sekret"})
        assert got.status_code == 503, got.text
        assert got.headers["retry-after"] == "1"
        assert "all 1 slots are busy" in got.json()["error"]["message"]
    finally:
        stream.close()


def metrics(server: LiveServer) -> dict[str, float]:
    """Parse the Prometheus text: every sample line must be `name{labels} value`."""
    samples = {}
    for line in httpx2.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_until_idle(server: LiveServer, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        slots = httpx2.get(server.url + "/slots").json()
        if not any(s["is_processing"] for s in slots) or time.monotonic() > deadline:
            return slots
        time.sleep(0.02)


ABORTED = 'specserve:request_success_total{finished_reason="abort",model_name="tiny"}'


def test_disconnect_mid_stream_frees_the_slot(live: LiveServer) -> None:
    wait_until_idle(live)
    before = metrics(live)[ABORTED]
    stream = client(live).completions.create(
        model=MODEL_ID, prompt="hello", max_tokens=500, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks), next(chunks)
    busy = httpx2.get(live.url + "/slots").json()
    assert sum(s["is_processing"] for s in busy) == 1
    stream.close()  # hang up
    assert not any(s["is_processing"] for s in wait_until_idle(live))
    assert metrics(live)[ABORTED] == before + 1


def test_disconnect_while_waiting_for_a_whole_response_frees_the_slot(live: LiveServer) -> None:
    wait_until_idle(live)
    before = metrics(live)[ABORTED]
    body = {"prompt": "hello", "max_tokens": 500, "temperature": 0}
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(live.url + "/v1/completions", json=body, timeout=0.2)
    assert not any(s["is_processing"] for s in wait_until_idle(live))
    assert metrics(live)[ABORTED] == before + 1


def test_metrics_count_requests_and_tokens(live: LiveServer) -> None:
    wait_until_idle(live)
    before = metrics(live)
    complete(live, "hello", max_tokens=7)
    after = metrics(live)
    tokens = 'specserve:generation_tokens_total{model_name="tiny"}'
    done = 'specserve:request_success_total{finished_reason="length",model_name="tiny"}'
    assert after[tokens] == before[tokens] + 7
    assert after[done] == before[done] + 1
    assert after['specserve:prompt_tokens_total{model_name="tiny"}'] > 0
    assert after['specserve:spec_decode_num_drafts_total{model_name="tiny"}'] == 0


def test_unknown_route_is_an_openai_error(live: LiveServer) -> None:
    got = httpx2.get(live.url + "/v1/nothing")
    assert got.status_code == 404 and got.json()["error"]["message"] == "Not Found"
