"""Several samples of one prompt (OpenAI's `n`) share one prefill.

The first sample is an ordinary request: it prefills the prompt. Its siblings wait here
and never prefill it. When the first one's prefill completes, each sibling that finds a
free slot gets a copy of the prompt's memory (`ModelRunner.fork`: attention KV and, for a
hybrid model, the recurrent state) and samples its first token from the same logits of the
last prompt row, with its own seed; from then on it decodes on its own, with speculation
as usual. Siblings that find no free slot get a saved copy of that memory and that row
(`PromptCopy`), held until the last of them has a slot, so they do not prefill either.
Such copies are few: waiting siblings take freed slots before any queued request, so
while one waits no new request starts, and at most one copy per slot exists.

Each sibling reports its whole prompt as found in the cache (`timings.cache_n`), so the
prompt is counted as prefilled once. If the first sample ends before its prefill
completes (aborted, failed), the next sibling prefills the prompt for the others.

The samples differ only by their seeds, which the caller gives them (the server: seed
s + i for choice i, engine/sampling.py draws from (seed, position)); greedy samples are
all equal.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from specserve.engine.request import Request
from specserve.engine.runner import ModelRunner, SavedSlot
from specserve.engine.scheduler import Scheduler


@dataclass
class PromptCopy:
    """The prompt's memory for siblings without a slot when it was prefilled."""

    saved: SavedSlot  # detached from the slot it came from
    logits: torch.Tensor  # [1, V] the last prompt row's (a copy: the engine reuses its buffer)


@dataclass
class Start:
    """A sibling just given a slot: where its prompt's memory comes from (the first
    sample's slot, or a saved copy), and the row its first token is sampled from."""

    request: Request
    source: int | PromptCopy
    logits: torch.Tensor  # [1, V]


class Samples:
    """Siblings waiting for their first sample's prefill, then for a slot; their starts."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self._pending: dict[int, list[Request]] = {}  # first sample's id -> its siblings
        self.late: deque[tuple[Request, PromptCopy]] = deque()  # prefilled, no slot yet

    @property
    def waiting(self) -> int:
        """Siblings not yet started (they wait for a slot as queued requests do)."""
        return sum(map(len, self._pending.values())) + len(self.late)

    def add(self, first: Request, siblings: list[Request]) -> None:
        if siblings:
            self._pending[first.id] = list(siblings)

    def prefilled(self, first: Request, logits: torch.Tensor) -> list[Start]:
        """first's prompt is in memory (logits: its last row [1, V]): its siblings take the
        free slots, the others get a saved copy of the prompt to wait with."""
        siblings = self._pending.pop(first.id, [])
        n_free = len(self.scheduler.free_slots)
        placed, late = siblings[:n_free], siblings[n_free:]
        if late:
            copy = PromptCopy(self.runner.save(first.slot), logits.clone())
            self.late.extend((req, copy) for req in late)
        for req in placed:
            self.scheduler.place(req)
        return [Start(req, first.slot, logits) for req in placed]

    def place_late(self) -> list[Start]:
        """Waiting siblings take the slots freed since, before any waiting request: they
        came with a request that is already running."""
        starts = []
        while self.late and self.scheduler.place(self.late[0][0]):
            req, copy = self.late.popleft()
            starts.append(Start(req, copy, copy.logits))
        return starts

    def copy_prompt(self, start: Start) -> None:
        """Fill a started sibling's slot with its prompt's memory."""
        if isinstance(start.source, PromptCopy):
            self.runner.restore(start.request.slot, start.source.saved)
        else:
            self.runner.fork(start.source, start.request.slot)

    def release(self, first: Request) -> None:
        """first ended before its prefill completed: the next sibling prefills for the rest."""
        siblings = self._pending.pop(first.id, [])
        if siblings:
            self.add(siblings[0], siblings[1:])
            self.scheduler.waiting.appendleft(siblings[0])

    def drop(self, req: Request) -> bool:
        """Forget a waiting sibling (aborted); False if it is not waiting here."""
        for first, siblings in self._pending.items():
            if any(s is req for s in siblings):
                self._pending[first] = [s for s in siblings if s is not req]
                return True
        late = [item for item in self.late if item[0] is not req]
        if len(late) == len(self.late):
            return False
        self.late = deque(late)
        return True
