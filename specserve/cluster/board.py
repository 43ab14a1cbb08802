"""`Board`: one small Ray actor where every replica posts, each period, its /health status
and its /metrics page; the ingress reads it for its own /health (how many replicas are
live) and /metrics (every replica's page, merged with a `replica` label).

A replica that stops posting (dead, or its process wedged) drops out after `stale_s`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

NAME = "specserve-board"
NAMESPACE = "specserve"
PERIOD_S = 1.0
SHARED_KEPT = 4096  # outputs the board holds for replicas to fetch


class Board:
    """The actor's class (ray.remote'd by the deploy code): replica id -> its last post;
    and, with --share-outputs, a log of the outputs replicas published (exchange.py)."""

    def __init__(self, stale_s: float = 5 * PERIOD_S, keep: int = SHARED_KEPT) -> None:
        self.stale_s = stale_s
        self.posts: dict[str, tuple[float, int, str]] = {}
        self.keep = keep
        self.shared: list[tuple[str, Any]] = []  # (publisher, output), the newest `keep`
        self.first = 0  # the log index of shared[0]: older entries were dropped

    def exchange(self, replica: str, outputs: list[Any], cursor: int) -> tuple[int, list[Any]]:
        """Publish a replica's new outputs; return (its new cursor, the outputs the others
        published since its cursor). A replica that lags past `keep` misses the oldest."""
        self.shared += [(replica, o) for o in outputs]
        drop = max(0, len(self.shared) - self.keep)
        self.shared, self.first = self.shared[drop:], self.first + drop
        start = max(cursor, self.first) - self.first
        theirs = [o for who, o in self.shared[start:] if who != replica]
        return self.first + len(self.shared), theirs

    def post(self, replica: str, health: int, metrics: str) -> None:
        self.posts[replica] = (time.monotonic(), health, metrics)

    def live(self) -> dict[str, tuple[int, str]]:
        """Replicas that posted within stale_s: their health status and metrics page."""
        now = time.monotonic()
        self.posts = {r: p for r, p in self.posts.items() if now - p[0] <= self.stale_s}
        return {r: (health, text) for r, (_, health, text) in self.posts.items()}


class _Merged(Collector):
    def __init__(self, pages: dict[str, str]) -> None:
        self.pages = pages

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for replica, text in sorted(self.pages.items()):
            for family in text_string_to_metric_families(text):
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                into.samples += _labelled(family.samples, replica)
        yield from merged.values()


def _labelled(samples: Iterable[Sample], replica: str) -> list[Sample]:
    return [s._replace(labels={**s.labels, "replica": replica}) for s in samples]


def merge_pages(pages: dict[str, str]) -> bytes:
    """Several replicas' Prometheus pages as one, each sample labelled with its replica."""
    from prometheus_client import generate_latest

    reg = CollectorRegistry()
    reg.register(_Merged(pages))
    return generate_latest(reg)
