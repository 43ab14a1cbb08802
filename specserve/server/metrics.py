"""GET /metrics: Prometheus exposition through prometheus_client, with vLLM's metric names
under `specserve:`.

vLLM's `vllm:spec_decode_num_drafts` (a counter, exposed with the `_total` suffix) becomes
`specserve:spec_decode_num_drafts_total`, and so on, so dashboards built for vLLM's panels
need only the prefix changed. Gauges and counters are read from the EngineStatus the engine
thread publishes (`EngineCollector`); the latency histograms are observed by the engine
thread as requests produce tokens and end (`Latency`). Each app has its own
CollectorRegistry: several servers may run in one process (the tests do).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from specserve.engine.engine import StepOutput
    from specserve.engine.request import Timings
    from specserve.server.loop import EngineLoop, Handle

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "specserve:"

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5]
TTFT_BUCKETS += [5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
ITL_BUCKETS += [7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0]
REQUEST_BUCKETS += [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class Latency:
    """vLLM's per-request latency histograms; only the engine thread observes them.

    time_to_first_token: arrival (the request's creation) to its first token being sampled.
    inter_token_latency: for each delivery of tokens after the first, the time since the
    request's previous delivery divided by the tokens in it, observed once per token (a
    verified draft brings several at once), so sum / count is the mean time per token.
    e2e_request_latency: arrival to the end (finished or aborted).
    request_queue_time: arrival to admission into a slot (requests that got one).
    """

    def __init__(self) -> None:
        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            # registry=None: EngineCollector exposes it, with the model_name label
            return Histogram(PREFIX + name, doc, registry=None, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time per output token.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency.", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time waiting for a slot.", REQUEST_BUCKETS)

    def delivered(self, out: StepOutput, handle: Handle) -> None:
        """Engine thread: a request's new tokens go to its handle (which keeps the time of
        its previous delivery)."""
        t, n = out.request.timings, len(out.tokens)
        now = time.perf_counter()
        if n and handle.t_last is None and t.t_first is not None:
            self.ttft.observe(t.t_first - t.t_start)
        elif n and handle.t_last is not None:
            gap = (now - handle.t_last) / n
            for _ in range(n):
                self.itl.observe(gap)
        if n:
            handle.t_last = now
        if out.finished:
            self.ended(t)

    def ended(self, t: Timings) -> None:
        """The request finished or was aborted: its end-to-end and queue times."""
        end = t.t_end if t.t_end is not None else time.perf_counter()
        self.e2e.observe(end - t.t_start)
        if t.t_admitted is not None:
            self.queue.observe(t.t_admitted - t.t_start)

    def families(self) -> Iterator[Metric]:
        """The four histograms' metric families, unlabelled."""
        yield from (m for h in (self.ttft, self.itl, self.e2e, self.queue) for m in h.collect())


GAUGE, COUNTER = GaugeMetricFamily, CounterMetricFamily


class EngineCollector(Collector):
    """Every specserve metric of one engine loop, labelled with the model's name."""

    def __init__(self, loop: EngineLoop, model: str) -> None:
        self.loop = loop
        self.model = model

    def collect(self) -> Iterator[Metric]:
        status = self.loop.status
        yield self._one(GAUGE, "num_requests_running", "Requests in a slot.", status.running)
        yield self._one(
            GAUGE, "num_requests_waiting", "Requests waiting for a slot.", status.waiting
        )
        success = CounterMetricFamily(
            PREFIX + "request_success_total",
            "Finished requests by finish reason (abort: cancelled or client gone).",
            labels=["model_name", "finished_reason"],
        )
        for reason, n in sorted(status.finished.items()):
            success.add_metric([self.model, reason], n)
        yield success
        yield self._one(
            COUNTER, "prompt_tokens_total", "Prompt tokens admitted.", status.prompt_tokens
        )
        yield self._one(
            COUNTER, "generation_tokens_total", "Tokens generated.", status.generation_tokens
        )
        yield from self._spec(status.spec or {})
        yield from self._store(status.store or {})
        if (exchange := self.loop.exchange) is not None:  # --share-outputs (exchange.py)
            yield self._one(
                COUNTER,
                "shared_outputs_sent_total",
                "Outputs sent to other replicas.",
                exchange.sent,
            )
            yield self._one(
                COUNTER,
                "shared_outputs_learned_total",
                "Other replicas' outputs learned.",
                exchange.learned,
            )
        for family in self.loop.latency.families():
            yield _labelled(family, self.model)

    def _one(
        self, kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, value: float
    ) -> Metric:
        """A metric with one sample, labelled with the model's name."""
        family = kind(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model], value)
        return family

    def _spec(self, stats: dict[str, Any]) -> Iterator[Metric]:
        """Speculative decoding counters; zeros without a speculator, so panels still draw."""
        for name, key, doc in (
            ("spec_decode_num_drafts_total", "drafts_generated", "Non-empty drafts proposed."),
            ("spec_decode_num_draft_tokens_total", "tokens_generated", "Draft tokens proposed."),
            ("spec_decode_num_accepted_tokens_total", "tokens_accepted", "Draft tokens accepted."),
        ):
            yield self._one(COUNTER, name, doc, stats.get(key, 0))
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted at each draft position (0 = first).",
            labels=["model_name", "position"],
        )
        for i, n in enumerate(stats.get("accepted_per_pos", [])):
            per_pos.add_metric([self.model, str(i)], n)
        yield per_pos

    def _store(self, stats: dict[str, int]) -> Iterator[Metric]:
        """The prompt store (engine/prompt_cache.py); zeros without one."""
        for kind, name, key, doc in (
            (COUNTER, "prompt_store_hits_total", "hits", "Prompts restored from the store."),
            (COUNTER, "prompt_store_misses_total", "misses", "Prompts no slot or entry gave."),
            (COUNTER, "prompt_store_hit_tokens_total", "hit_tokens", "Tokens restored."),
            (COUNTER, "prompt_store_evictions_total", "evictions", "Entries evicted (LRU)."),
            (GAUGE, "prompt_store_entries", "entries", "Entries held."),
            (GAUGE, "prompt_store_bytes", "bytes", "Bytes held."),
            (GAUGE, "prompt_store_budget_bytes", "budget", "The byte budget (--cache-ram)."),
        ):
            yield self._one(kind, name, doc, stats.get(key, 0))


def _labelled(family: Metric, model: str) -> Metric:
    """The histogram's family with model_name added to every sample (vLLM's labels)."""
    out = Metric(family.name, family.documentation, family.type, family.unit)
    for s in family.samples:
        out.add_sample(s.name, {"model_name": model, **s.labels}, s.value, s.timestamp)
    return out


def registry(loop: EngineLoop, model: str) -> CollectorRegistry:
    """One app's registry (never prometheus_client's global one)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(loop, model))
    return reg


def render(reg: CollectorRegistry) -> bytes:
    """The whole /metrics page."""
    return generate_latest(reg)
