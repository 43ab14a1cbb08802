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
