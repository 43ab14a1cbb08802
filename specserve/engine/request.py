"""Request: one generation's tokens, settings, state and statistics."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from specserve.engine.logprobs import TokenLogprob
from specserve.engine.sampling import SamplingParams
from specserve.speculative.verify import Constraint

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class SpecParams:
    """Per-request speculation: n_max = 0 turns it off for this request.

    n_max / n_min: most / fewest draft tokens (shorter drafts are dropped); p_min: a draft
    model stops before a token it gives less probability (llama.cpp's default 0.75), a head
    (eagle3, mtp) after its first, whose confidence it learns to judge (speculative/mtp.py);
    types: the speculator types this request may use (None = all that are loaded);
    alternatives: runners-up a head may offer for each draft token (speculative/verify.py
    `verify_greedy`).
    """

    n_max: int = 16
    n_min: int = 0
    p_min: float = 0.75
    types: tuple[str, ...] | None = None
    alternatives: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.n_min <= max(self.n_max, 0) or self.n_max < 0:
            raise ValueError(f"need 0 <= draft-min <= draft-max, got {self.n_min} and {self.n_max}")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"draft p-min must be in [0, 1], got {self.p_min}")
        if self.alternatives < 0:
            raise ValueError(f"draft alternatives must be >= 0, got {self.alternatives}")


@dataclass
class Timings:
    """llama.cpp's per-response timing fields, plus draft counts."""

    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_end: float | None = None
    t_admitted: float | None = None  # when it first got a slot (queue time = this - t_start)
    prompt_n: int = 0  # prompt tokens prefilled (llama.cpp's: the cached ones not counted)
    cache_n: int = 0  # prompt tokens whose state the slot already held (prompt cache)
    predicted_n: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0

    def admitted(self) -> None:
        """The scheduler gave it a slot; a recomputed request keeps its first admission."""
        if self.t_admitted is None:
            self.t_admitted = time.perf_counter()

    def as_dict(self) -> dict[str, float | int]:
        first = self.t_first or time.perf_counter()
        end = self.t_end or time.perf_counter()
        prompt_ms = (first - self.t_start) * 1e3
        predicted_ms = (end - first) * 1e3
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_second": self.prompt_n / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": predicted_ms,
            # the first token comes from the prompt pass; the rest from decoding
            "predicted_per_second": (self.predicted_n - 1) / predicted_ms * 1e3
            if predicted_ms > 0 and self.predicted_n > 1
            else 0.0,
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
        }


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    spec: SpecParams = field(default_factory=SpecParams)
    stop_ids: frozenset[int] = frozenset()
    id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if asked
    status: Status = Status.WAITING
    finish_reason: str | None = None
    slot: int = -1
    n_prefilled: int = 0
    cache_prompt: bool = True  # may start after a prefix its slot still holds
    # the tenant: prefixes and speculators' cross-request tables are shared within one only
    cache_salt: str | None = None
    prediction: list[int] = field(default_factory=list)  # expected output (a draft source)
    constraint: Constraint | None = None  # the grammar its output follows, if any
    seed: int = 0
    recomputed: bool = False  # its slot was lost once (a failed forward) and rebuilt
    timings: Timings = field(default_factory=Timings)

    @property
    def context(self) -> list[int]:
        """Prompt + output; the last output token is not yet in the model's memory."""
        return self.prompt + self.output

    @property
    def prefill_ids(self) -> list[int]:
        """What its slot must hold before it decodes: the prompt, or, when a lost slot is
        recomputed, the context less the newest token (fed by the next decode step)."""
        return self.prompt + self.output[:-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
