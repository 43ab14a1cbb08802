"""2 Ray Serve replicas of the tiny float64 model on a local Ray instance (1 CPU each).

Slow: Ray takes a while to start; the first test is also `smoke` (CI's short subset)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from specserve.loading.model import LoadedModel
from specserve.server.transport import free_port
from tests.server.conftest import LiveServer, start_server

ray = pytest.importorskip("ray", reason="the cluster extra (make setup-cluster)")
pytestmark = pytest.mark.slow
REPLICA = "x-specserve-replica"


@pytest.fixture(scope="module")
def cluster(tiny_folder: Path) -> Iterator[str]:
    from specserve.cli import build_parser
    from specserve.cluster import deploy

    argv = [
        "serve",
        "--model",
        str(tiny_folder),
        "--alias",
        "tiny",
        "--dtype",
        "float64",
        "-np",
        "2",
    ]
    argv += ["--ctx-size", "512", "--threads", "1", "--port", str(free_port())]
    argv += ["--replicas", "2", "--affinity-threshold", "1", "--affinity-min-match", "8"]
    argv += ["--share-outputs"]
    args = build_parser().parse_args(argv)
    from specserve.ops.cpu import build

    build.problem()  # the kernels built here, not by two replicas racing for the build lock
    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=deploy._runtime_env())
    try:
        url = deploy.start(args)
        print(f"cluster up in {time.monotonic() - t0:.0f} s")
        yield url
    finally:
        t0 = time.monotonic()
        deploy.stop()
        print(f"cluster down in {time.monotonic() - t0:.0f} s")


@pytest.fixture(scope="module")
def single(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    server = start_server(tiny_model, parallel=2, spec_types=("ngram-map-k", "suffix"))
    yield server
    server.stop()


def chat(url: str, messages: list[dict[str, str]], **extra: Any) -> httpx2.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    r = httpx2.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def sse_events(text: str) -> list[dict[str, Any]]:
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


@pytest.mark.smoke
def test_answers_equal_one_server_and_a_second_turn_stays_on_its_replica(
    cluster: str, single: LiveServer
) -> None:
    # asked first: a replica is on the board before Serve marks it running
    health = httpx2.get(f"{cluster}/health", timeout=30)
    assert health.status_code == 200 and health.json()["replicas"] == 2
    turn1 = [{"role": "user", "content": "tell me a story about a cat and a dog"}]
    got, want = chat(cluster, turn1), chat(single.url, turn1)
    answer = got.json()["choices"][0]["message"]["content"]
    assert answer == want.json()["choices"][0]["message"]["content"]
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and then?"},
    ]
    second = chat(cluster, turn2)
    assert second.headers[REPLICA] == got.headers[REPLICA]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second.json()["choices"] == chat(single.url, turn2).json()["choices"]
    # streamed through Ray Serve's proxy: the same text, chunk by chunk
    r = chat(cluster, turn1, stream=True)
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in sse_events(r.text)]
    assert "".join(deltas) == answer
    page = httpx2.get(f"{cluster}/metrics", timeout=30).text
    assert page.count("specserve:num_requests_running{") == 2  # one sample per replica


def _metric_sum(page: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in page.splitlines() if ln.startswith(name))


def test_replicas_learn_each_others_outputs(cluster: str) -> None:
    """--share-outputs: an answer one replica gave reaches the other's speculators."""
    chat(cluster, [{"role": "user", "content": "an answer worth sharing"}])
    deadline = time.monotonic() + 30
    while True:  # the replicas trade outputs through the board once a second
        page = httpx2.get(f"{cluster}/metrics", timeout=30).text
        sent = _metric_sum(page, "specserve:shared_outputs_sent_total{")
        learned = _metric_sum(page, "specserve:shared_outputs_learned_total{")
        if sent >= 1 and learned >= 1:
            break
        assert time.monotonic() < deadline, (sent, learned)
        time.sleep(0.5)


def test_bad_input_is_the_one_server_error(cluster: str) -> None:
    r = httpx2.post(f"{cluster}/v1/chat/completions", json={"messages": 3}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_overloaded_affine_replica_sends_turns_to_the_least_loaded(cluster: str) -> None:
    base = [{"role": "user", "content": "a long shared conversation start, " * 3}]
    home = chat(cluster, base).headers[REPLICA]
    turns = [base + [{"role": "user", "content": f"question {i}"}] for i in range(4)]
    seen: list[str] = []

    def ask(messages: list[dict[str, str]]) -> None:
        seen.append(chat(cluster, messages, max_tokens=300).headers[REPLICA])

    threads = [threading.Thread(target=ask, args=(t,)) for t in turns]
    for t in threads:
        t.start()
        time.sleep(0.05)  # routed one after another, each seeing the queues the last left
    for t in threads:
        t.join(180)
    # threshold 1: the home replica takes turns until it is 2 requests ahead, then not
    assert home in seen and any(r != home for r in seen), seen


def _replica_actor(replica_id: str) -> Any:
    names = ray.util.list_named_actors(all_namespaces=True)
    name = next(n["name"] for n in names if n["name"].endswith(replica_id))
    return ray.get_actor(name, namespace="serve")


def test_a_killed_replica_loses_no_unstarted_request(cluster: str) -> None:
    prompt = [{"role": "user", "content": "a stream to cut short"}]
    body = {"model": "tiny", "messages": prompt, "max_tokens": 400, "stream": True}
    events: list[str] = []
    victim: list[str] = []
    with httpx2.stream("POST", f"{cluster}/v1/chat/completions", json=body, timeout=120) as r:
        victim.append(r.headers[REPLICA])
        lines = r.iter_lines()
        events.append(next(lines))  # streaming has begun
        others = [
            threading.Thread(target=chat, args=(cluster, [{"role": "user", "content": f"q{i}"}]))
            for i in range(4)
        ]
        for t in others:
            t.start()  # queued behind the stream on either replica
        ray.kill(_replica_actor(victim[0]), no_restart=False)
        events += list(lines)
    for t in others:
        t.join(180)
        assert not t.is_alive()  # chat() asserted 200 for each
    data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert "error" in data[-1], events[-3:]
    # Ray starts a new replica in its place; /health counts it once it posts
    deadline = time.monotonic() + 120
    while httpx2.get(f"{cluster}/health", timeout=30).json().get("replicas") != 2:
        assert time.monotonic() < deadline, "the replica was not restarted"
        time.sleep(1)
