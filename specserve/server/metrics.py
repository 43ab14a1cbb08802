"""GET /metrics: Prometheus text exposition, with vLLM's metric names under `specserve:`.

vLLM's `vllm:spec_decode_num_drafts` (a counter, exposed with the `_total` suffix) becomes
`specserve:spec_decode_num_drafts_total`, and so on, so dashboards built for vLLM's
speculative-decoding panels need only the prefix changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from specserve.server.loop import Snapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "specserve:"


def _metric(
    name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]]
) -> list[str]:
    full = PREFIX + name
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    for labels, value in samples:
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        lines.append(f"{full}{{{text}}} {value}" if text else f"{full} {value}")
    return lines


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(snap: Snapshot, model: str) -> str:
    """The whole /metrics page for one engine snapshot."""
    m = {"model_name": model}
    lines = [
        *_metric("num_requests_running", "gauge", "Requests in a slot.", [(m, snap.running)]),
        *_metric(
            "num_requests_waiting", "gauge", "Requests waiting for a slot.", [(m, snap.waiting)]
        ),
        *_metric(
            "request_success_total",
            "counter",
            "Finished requests by finish reason (abort: cancelled or client gone).",
            [({**m, "finished_reason": r}, n) for r, n in sorted(snap.finished.items())],
        ),
        *_metric(
            "prompt_tokens_total", "counter", "Prompt tokens admitted.", [(m, snap.prompt_tokens)]
        ),
        *_metric(
            "generation_tokens_total",
            "counter",
            "Tokens generated.",
            [(m, snap.generation_tokens)],
        ),
        *_spec_metrics(snap.spec or {}, m),
    ]
    return "\n".join(lines) + "\n"


def _spec_metrics(stats: dict[str, Any], m: dict[str, str]) -> list[str]:
    """Speculative decoding counters; zeros without a speculator, so panels still draw."""
    per_pos: list[int] = list(stats.get("accepted_per_pos", []))
    return [
        *_metric(
            "spec_decode_num_drafts_total",
            "counter",
            "Non-empty drafts proposed.",
            [(m, stats.get("drafts_generated", 0))],
        ),
        *_metric(
            "spec_decode_num_draft_tokens_total",
            "counter",
            "Draft tokens proposed.",
            [(m, stats.get("tokens_generated", 0))],
        ),
        *_metric(
            "spec_decode_num_accepted_tokens_total",
            "counter",
            "Draft tokens accepted.",
            [(m, stats.get("tokens_accepted", 0))],
        ),
        *_metric(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "counter",
            "Draft tokens accepted at each draft position (0 = first).",
            [({**m, "position": str(i)}, n) for i, n in enumerate(per_pos)],
        ),
    ]
