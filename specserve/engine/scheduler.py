"""Scheduler: parallel slots, admission of waiting requests, chunked prefill.

A new request goes to the free slot the prompt cache picks, and its prefill starts after
the prefix that slot still holds (engine/prompt_cache.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specserve.engine.prompt_cache import PromptCache
from specserve.engine.request import Request, Status


@dataclass
class StepPlan:
    """prefill: (request, chunk of prompt tokens, is the last chunk); decode: requests."""

    prefill: list[tuple[Request, list[int], bool]]
    decode: list[Request]

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)

    @property
    def rows(self) -> int:
        """Rows the step's forward has before drafts: its prompt chunks' and a decoding
        slot's one each."""
        return sum(len(chunk) for _, chunk, _ in self.prefill) + len(self.decode)

    @property
    def requests(self) -> list[Request]:
        """Every request the step's forward carries."""
        return [r for r, _, _ in self.prefill] + self.decode


class Scheduler:
    def __init__(self, num_slots: int, prefill_chunk: int, cache: PromptCache) -> None:
        self.free_slots = list(range(num_slots))[::-1]  # unused ones are taken from the end
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefill_chunk = prefill_chunk

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        while self.waiting and self.free_slots:
            self._admit(self.waiting.popleft())
        plan = StepPlan([], [])
        budget = self.prefill_chunk  # prompt tokens per step, shared by prefilling slots
        # a recomputed request's first forward runs alone, so one that breaks forwards
        # fails without taking its batch-mates along again
        alone = [r for r in self.running if r.recomputed and r.n_prefilled == 0]
        for req in alone[:1] or self.running:
            if req.status is Status.DECODE:
                plan.decode.append(req)
            elif budget > 0:
                ids = req.prefill_ids
                start = req.n_prefilled
                chunk = ids[start : start + budget]
                budget -= len(chunk)
                plan.prefill.append((req, chunk, start + len(chunk) == len(ids)))
        return plan

    def _admit(self, req: Request) -> None:
        ids = req.prefill_ids
        use_cache = req.cache_prompt and not req.recomputed
        req.slot, req.n_prefilled = self.cache.take(self.free_slots, ids, use_cache, req.cache_salt)
        self.free_slots.remove(req.slot)
        if not req.recomputed:
            req.timings.cache_n = req.n_prefilled
            req.timings.prompt_n = len(ids) - req.n_prefilled
        req.status = Status.PREFILL
        req.timings.admitted()
        self.running.append(req)

    def place(self, req: Request) -> bool:
        """Give a request whose prompt memory the engine copies in (a sample of a prompt
        prefilled once, engine/samples.py) a free slot, as if its prompt were all cached;
        False when no slot is free. The slot's own held prefix is dropped."""
        if not self.free_slots:
            return False
        req.slot, _ = self.cache.take(self.free_slots, req.prompt, use=False)
        self.free_slots.remove(req.slot)
        req.n_prefilled = len(req.prompt)
        req.timings.cache_n, req.timings.prompt_n = len(req.prompt), 0
        req.status = Status.PREFILL
        req.timings.admitted()
        self.running.append(req)
        return True

    def recompute(self, req: Request) -> None:
        """Its slot was lost: free it, and queue the request first to be rebuilt."""
        self.running.remove(req)
        self.free_slots.append(req.slot)
        req.recomputed, req.n_prefilled, req.status = True, 0, Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.running.remove(req)
        self.free_slots.append(req.slot)
