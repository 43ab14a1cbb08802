"""What the engine thread and the HTTP side exchange (server/loop.py): token events, the
published engine status, and the failures a handler can meet."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.engine.engine import Engine
from specserve.engine.logprobs import TokenLogprob

Timings = dict[str, float | int]


class QueueFull(Exception):
    """Every slot is busy and `--max-queue` requests already wait."""


class EngineFailure(Exception):
    """The engine failed while running a request (500), or is not running (503)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Event:
    """What a handler receives: new tokens, and at the end the reason and timings."""

    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    timings: Timings | None = None
    error: Exception | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, if asked
    drafted: int = 0  # the first `drafted` tokens are accepted draft tokens
    drafted_by: str = ""  # the type of the speculator that proposed them


@dataclass(frozen=True)
class EngineStatus:
    """Engine state as the HTTP side may read it (built by the engine thread)."""

    slots: list[dict[str, Any]] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    spec: dict[str, Any] | None = None


def slot_states(engine: Engine) -> list[dict[str, Any]]:
    """One llama.cpp-like entry per slot (GET /slots): idle, or the request it runs."""
    by_slot = {r.slot: r for r in engine.scheduler.running}
    n_ctx = engine.max_len
    states: list[dict[str, Any]] = []
    for slot in range(engine.num_slots):
        req = by_slot.get(slot)
        state: dict[str, Any] = {"id": slot, "id_task": -1, "n_ctx": n_ctx}
        state |= {"is_processing": req is not None, "state": "idle", "speculative": False}
        if req is not None:
            state |= {
                "id_task": req.id,
                "state": req.status.value,
                "speculative": engine.speculator is not None and req.spec.n_max > 0,
                "n_prompt_tokens": len(req.prompt),
                "n_prompt_tokens_processed": req.n_prefilled,
                "next_token": {
                    "has_next_token": True,
                    "n_decoded": len(req.output),
                    "n_remain": req.params.max_tokens - len(req.output),
                },
            }
        states.append(state)
    return states
