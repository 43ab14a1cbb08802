"""The board without Ray: stale replicas drop out; metrics pages merge with a replica label."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specserve.cluster.board import Board, merge_pages


def page(running: int, prompt_tokens: int) -> str:
    """A replica's /metrics page as prometheus_client writes it."""
    reg = CollectorRegistry()
    Gauge(RUNNING, "Requests running.", ["model_name"], registry=reg).labels("tiny").set(running)
    c = Counter("specserve:prompt_tokens", "Prompt tokens.", ["model_name"], registry=reg)
    c.labels("tiny").inc(prompt_tokens)
    return generate_latest(reg).decode()


RUNNING = "specserve:num_requests_running"


def test_live_replicas_are_those_that_posted_lately() -> None:
    board = Board(stale_s=0.2)
    board.post("a", 200, "")
    board.post("b", 503, "")
    assert board.live() == {"a": (200, ""), "b": (503, "")}
    time.sleep(0.3)
    board.post("b", 200, "")
    assert board.live() == {"b": (200, "")}


def test_pages_merge_into_one_family_per_metric_labelled_by_replica() -> None:
    merged = merge_pages({"a": page(1, 10), "b": page(2, 30)}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    running = {s.labels["replica"]: s.value for s in families[RUNNING].samples}
    assert running == {"a": 1, "b": 2}
    prompt = families["specserve:prompt_tokens"]
    assert prompt.type == "counter"
    assert sum(s.value for s in prompt.samples if s.name.endswith("_total")) == 40
    assert merged.count(f"# TYPE {RUNNING} gauge") == 1


def test_exchange_gives_each_replica_the_others_outputs() -> None:
    board = Board(keep=3)
    cursor_a, got = board.exchange("a", [[1], [2]], 0)
    assert (cursor_a, got) == (2, [])
    cursor_b, got = board.exchange("b", [[3]], 0)
    assert (cursor_b, got) == (3, [[1], [2]])  # not its own
    cursor_a, got = board.exchange("a", [[4], [5]], cursor_a)
    assert (cursor_a, got) == (5, [[3]])
    # b lags: the log kept the newest 3 ([3], [4], [5]), so it misses none of a's new ones
    cursor_b, got = board.exchange("b", [], cursor_b)
    assert (cursor_b, got) == (5, [[4], [5]])
    _, got = board.exchange("c", [], 0)  # a newcomer gets what is still kept
    assert got == [[3], [4], [5]]
