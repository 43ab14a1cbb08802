"""/health tells the truth (loading, stalled, dead engine) and /metrics is prometheus_client's.

Faults are injected into the live tiny server's engine: a warm-up that waits for the test, a
step that blocks, a step that kills the engine thread. Every wait is bounded, so a request
that would hang fails the test instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.loading.model import LoadedModel
from specserve.server import loop as loop_module
from specserve.server.health import warm_up
from tests.server.conftest import LiveServer, start_server

BODY = {"prompt": "hello", "max_tokens": 6, "temperature": 0}


def health(server: LiveServer) -> tuple[int, dict[str, Any]]:
    got = httpx2.get(server.url + "/health", timeout=5)
    return got.status_code, got.json()


def wait_for(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Call(threading.Thread):
    """One HTTP request in a thread: its response (or exception) once it returns."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: httpx2.Response | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            self.response = httpx2.post(self.url + "/v1/completions", json=self.body, timeout=20)
        except Exception as e:  # reported by the test's assertions
            self.error = e


@pytest.fixture
def server(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    live = start_server(tiny_model, parallel=1)
    assert wait_for(lambda: health(live)[0] == 200, 30), "never ready"
    yield live
    live.stop()


def test_warm_up_leaves_nothing_behind(tiny_model: LoadedModel) -> None:
    assert tiny_model.tokenizer is not None
    prompt = tiny_model.tokenizer.encode("hello")

    def generate(warm: bool) -> list[int]:
        engine = Engine(ModelRunner(tiny_model.model, num_slots=1, max_len=64))
        if warm:
            warm_up(engine.runner)
            assert engine.runner.memory.length(0) == 0
            assert engine.prompts.take([0], prompt) == (0, 0)  # no cached prefix to reuse
        req = Request(prompt, SamplingParams(temperature=0, max_tokens=8), SpecParams(n_max=0))
        return engine.generate([req])[0].output

    assert generate(warm=True) == generate(warm=False)


def test_health_is_loading_until_the_warm_up_has_run(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, warmed = threading.Event(), threading.Event()

    def slow_warm_up(runner: ModelRunner) -> None:
        assert gate.wait(30)
        warm_up(runner)
        warmed.set()

    monkeypatch.setattr(loop_module, "warm_up", slow_warm_up)
    live = start_server(tiny_model, parallel=1)
    try:
        status, body = health(live)
        assert (status, body["status"]) == (503, "loading")
        early = Call(live.url, BODY)  # waits in the inbox for the warm-up
        early.join(0.3)
        assert early.is_alive() and not warmed.is_set()
        gate.set()
        assert wait_for(lambda: health(live) == (200, {"status": "ok"}), 10)
        early.join(20)
        assert early.response is not None and early.response.status_code == 200
        again = httpx2.post(live.url + "/v1/completions", json=BODY, timeout=20)
        assert early.response.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    finally:
        gate.set()
        live.stop()


def test_health_says_stalled_while_a_step_hangs(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = server.loop
    loop.health.stall_timeout = 0.3
    time.sleep(0.5)  # idle for longer than the timeout: that is no stall
    assert health(server) == (200, {"status": "ok"})
    release = threading.Event()
    real_step = loop.engine.step

    def hanging_step() -> list:
        assert release.wait(30)
        return real_step()

    monkeypatch.setattr(loop.engine, "step", hanging_step)
    call = Call(server.url, BODY)
    try:
        assert wait_for(lambda: health(server)[1]["status"] == "stalled", 10)
        status, body = health(server)
        assert status == 503 and "no step has finished" in body["message"]
    finally:
        release.set()
    call.join(20)
    assert call.response is not None and call.response.status_code == 200
    assert wait_for(lambda: health(server) == (200, {"status": "ok"}), 5)


class Killed(BaseException):
    """Not an Exception: nothing in the engine loop catches it, so the thread dies."""


def test_a_dead_engine_thread_fails_every_request_and_health_says_so(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = server.loop
    kill, inside, release = threading.Event(), threading.Event(), threading.Event()
    real_step = loop.engine.step

    def step() -> list:
        if kill.is_set():
            inside.set()
            assert release.wait(30)
            raise Killed("killed on purpose")
        return real_step()

    monkeypatch.setattr(loop.engine, "step", step)
    streaming = {**BODY, "max_tokens": 400, "stream": True}
    with httpx2.stream("POST", server.url + "/v1/completions", json=streaming, timeout=20) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it runs
        kill.set()
        assert inside.wait(10)  # the engine thread is in its last step: the rest queue
        waiting = [Call(server.url, BODY), Call(server.url, {**BODY, "stream": True})]
        waiting.append(Call(server.url, BODY))
        assert wait_for(lambda: loop._in_flight == 4, 10)
        release.set()
        t0 = time.monotonic()
        assert wait_for(lambda: health(server)[0] == 503, 1.0)
        assert time.monotonic() - t0 < 1.0
        rest = list(lines)  # the running stream ends, with the failure in it
    assert any("Killed: killed on purpose" in line for line in rest), rest
    status, body = health(server)
    assert body["status"] == "error" and "Killed: killed on purpose" in body["message"]
    for call in waiting:
        call.join(10)
        assert not call.is_alive(), "a queued request hangs"
        assert call.response is not None and call.response.status_code == 503
        assert "Killed" in call.response.json()["error"]["message"]
    t0 = time.monotonic()
    late = httpx2.post(server.url + "/v1/completions", json=BODY, timeout=5)
    assert late.status_code == 503 and time.monotonic() - t0 < 1.0


def samples(server: LiveServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    page = httpx2.get(server.url + "/metrics", timeout=5)
    assert page.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page.text)  # parses the whole page
        for s in family.samples
    }


def test_metrics_histograms_count_each_request(server: LiveServer) -> None:
    model = (("model_name", "tiny"),)
    names = ["time_to_first_token", "inter_token_latency", "e2e_request_latency"]
    names.append("request_queue_time")
    counts = [(f"specserve:{n}_seconds_count", model) for n in names]
    before = samples(server)
    got = httpx2.post(server.url + "/v1/completions", json=BODY, timeout=20)
    assert got.json()["usage"]["completion_tokens"] == 6
    after = samples(server)
    # one first token, five later ones (one inter-token gap each), one end, one admission
    assert [after[c] - before.get(c, 0.0) for c in counts] == [1, 5, 1, 1]
    e2e = after[("specserve:e2e_request_latency_seconds_sum", model)]
    assert e2e > after[("specserve:time_to_first_token_seconds_sum", model)] > 0
    inf = (("le", "+Inf"), ("model_name", "tiny"))
    assert after[("specserve:e2e_request_latency_seconds_bucket", inf)] == after[counts[2]]
    existing = {
        "num_requests_running",
        "num_requests_waiting",
        "request_success_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
    }
    assert {f"specserve:{n}" for n in existing} <= {name for name, _ in after}
    done = ("specserve:request_success_total", (("finished_reason", "length"), *model))
    assert after[done] == before[done] + 1
