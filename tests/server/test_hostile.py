"""Hostile input: every bad or extreme request gets a 4xx with OpenAI's error body or a
correct answer, never a 5xx, while a victim stream beside it keeps its usual text and the
event loop keeps answering /health within 250 ms (tiny float64 model, 2 drafting slots)."""

from __future__ import annotations

import copy
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest

from specserve.bench.hostile import CHAT, Case, encode, hostile_cases
from specserve.loading.model import LoadedModel
from specserve.loading.tokenizer import Tokenizer
from tests.server.conftest import CHAT_TEMPLATE, CTX, MODEL_ID, LiveServer, start_server

SPEC = ("ngram-map-k", "suffix", "prediction")
# the usual template, refusing (raise_exception, as Qwen's and Llama's do) a first tool turn
STRICT_TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}"
    "{{ raise_exception('a conversation cannot start with a tool turn') }}{% endif %}"
    + CHAT_TEMPLATE
)
VICTIM = {
    "model": MODEL_ID,
    "messages": [{"role": "user", "content": "the victim asks the same thing every time"}],
    "max_tokens": 120,
    "temperature": 0,
    "stream": True,
}
MAX_LOOP_STALL_S = 0.25


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], **fields}


# the benchmark's hostile client sends the same table; this server's template adds one
CASES: dict[str, Case] = {
    **hostile_cases(MODEL_ID),
    "template-raise_exception": (
        CHAT,
        _chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "c"}]),
        frozenset({400}),
    ),
}


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    assert tiny_model.tokenizer is not None
    hf = copy.deepcopy(tiny_model.tokenizer.hf)
    hf.chat_template = STRICT_TEMPLATE
    loaded = dataclasses.replace(tiny_model, tokenizer=Tokenizer(hf))
    live = start_server(loaded, parallel=2, spec_types=SPEC)
    yield live
    live.stop()


def _post(server: LiveServer, path: str, body: dict[str, Any] | str) -> httpx2.Response:
    headers = {"Content-Type": "application/json"}
    return httpx2.post(server.url + path, content=encode(body), headers=headers, timeout=60)


def _victim_text(server: LiveServer) -> str:
    parts = []
    with httpx2.stream("POST", server.url + "/v1/chat/completions", json=VICTIM, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                parts += [c["delta"].get("content") or "" for c in chunk["choices"]]
    return "".join(parts)


class Background:
    """Runs `work` in a loop on a thread until stopped; collects what each run returns."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.results: list[Any] = []
        self._stop = threading.Event()
        self._work = work
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.results.append(self._work())

    def stop(self) -> list[Any]:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive()
        return self.results


def _ticker(server: LiveServer) -> Callable[[], float]:
    """One /health round trip on a kept-alive connection, every 50 ms: its time is how long
    the server's event loop kept it waiting."""
    session = httpx2.Client(base_url=server.url, timeout=10)

    def tick() -> float:
        t0 = time.perf_counter()
        assert session.get("/health").status_code == 200
        seconds = time.perf_counter() - t0
        time.sleep(0.05)
        return seconds

    return tick


def test_no_hostile_request_gets_a_5xx_or_harms_a_victim(server: LiveServer) -> None:
    usual = _victim_text(server)
    victim = Background(lambda: _victim_text(server))
    ticker = Background(_ticker(server))
    got = {}
    try:
        for name, (path, body, allowed) in CASES.items():
            r = _post(server, path, body)
            got[name] = r.status_code
            assert r.status_code in allowed, (name, r.status_code, r.text[:300])
            if r.status_code >= 400:
                error = r.json()["error"]
                assert error["message"] and error["type"] == "invalid_request_error", name
    finally:
        texts = victim.stop()
        latencies = ticker.stop()
    assert texts and all(t == usual for t in texts)
    assert max(latencies) < MAX_LOOP_STALL_S, sorted(latencies)[-5:]
    assert httpx2.get(server.url + "/health").json() == {"status": "ok"}


def test_a_limit_names_itself(server: LiveServer) -> None:
    r = _post(server, "/v1/chat/completions", _chat(stop=["x"] * 17))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert "at most 16" in r.json()["error"]["message"]


def test_typed_special_tokens_are_text_not_control_tokens(server: LiveServer) -> None:
    """`<|endoftext|>` typed into a message is 13 characters of text, as a same-length
    non-token is, so no user can end or forge a turn."""

    def prompt_tokens(content: str) -> int:
        body = _chat(messages=[{"role": "user", "content": content}], max_tokens=1)
        return _post(server, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"]

    assert prompt_tokens("<|endoftext|>") == prompt_tokens("<|endoftexx|>")


def test_a_requests_speculator_choice_is_the_one_that_drafts(server: LiveServer) -> None:
    """types=["prediction"] drafts from the prediction only; types=["suffix"] never
    from it, even with a prediction that is the answer itself."""
    chain = server.loop.engine.speculator
    assert chain is not None
    children = {c.name: c for c in chain.children}  # type: ignore[attr-defined]
    prompt = [{"role": "user", "content": "repeat after me"}]
    answer = _post(
        server, "/v1/chat/completions", _chat(messages=prompt, max_tokens=40, temperature=0)
    )
    text = answer.json()["choices"][0]["message"]["content"]

    def drafted(types: list[str]) -> dict[str, int]:
        before = {n: c.stats.tokens_generated for n, c in children.items()}
        body = _chat(
            messages=prompt,
            max_tokens=40,
            temperature=0,
            prediction={"type": "content", "content": text},
            speculative={"types": types},
        )
        r = _post(server, "/v1/chat/completions", body)
        assert r.json()["choices"][0]["message"]["content"] == text
        return {n: c.stats.tokens_generated - before[n] for n, c in children.items()}

    only_prediction = drafted(["prediction"])
    assert only_prediction["prediction"] > 0
    assert only_prediction["suffix"] == only_prediction["ngram-map-k"] == 0
    assert drafted(["suffix"])["prediction"] == 0


def _drop_after(server: LiveServer, body: dict[str, Any], after_bytes: int) -> None:
    """Send a streaming request and hang up once `after_bytes` of the answer came back."""
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        s.sendall(head.encode() + data)
        received = b""
        while len(received) < after_bytes:
            chunk = s.recv(4096)
            if not chunk:
                break
            received += chunk


def test_clients_gone_mid_prefill_and_mid_verify_free_their_slots(server: LiveServer) -> None:
    usual = _victim_text(server)
    long_prompt = "a prompt long enough to take several prefill chunks " * (CTX // 60)
    mid_prefill = _chat(messages=[{"role": "user", "content": long_prompt[: CTX - 40]}])
    repeat = "one two three four five six " * 6
    mid_verify = _chat(
        messages=[{"role": "user", "content": repeat}],
        prediction={"type": "content", "content": repeat},
        max_tokens=200,
        stream=True,
    )
    for _ in range(3):
        _drop_after(server, {**mid_prefill, "stream": True, "max_tokens": 200}, 0)
        _drop_after(server, mid_verify, 400)
    deadline = time.monotonic() + 30
    while server.loop.status.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.loop.status.running == 0  # every slot was freed
    assert _victim_text(server) == usual


def test_an_unexpected_failure_is_a_500_body_with_the_request_id(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_: Any) -> list[int]:
        raise RuntimeError("a bug no client could cause")

    monkeypatch.setattr(Tokenizer, "chat", broken)
    headers = {"X-Request-Id": "trace-42"}
    r = httpx2.post(server.url + "/v1/chat/completions", json=_chat(), headers=headers)
    assert r.status_code == 500 and r.headers["x-request-id"] == "trace-42"
    error = r.json()["error"]
    assert error["type"] == "server_error" and "trace-42" in error["message"]
    assert "Traceback" not in r.text and "a bug" not in r.text
    assert any("trace-42" in rec.getMessage() for rec in caplog.records)
    # a refused request is named too, with a fresh id when the client sends none
    r = httpx2.post(server.url + "/v1/chat/completions", json=_chat(n=17))
    assert r.status_code == 400 and r.headers["x-request-id"].startswith("req_")
