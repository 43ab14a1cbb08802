"""Scheduler: parallel slots, admission of waiting requests, chunked prefill."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specserve.engine.request import Request, Status


@dataclass
class StepPlan:
    """prefill: (request, chunk of prompt tokens, is the last chunk); decode: requests."""

    prefill: list[tuple[Request, list[int], bool]]
    decode: list[Request]

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(self, num_slots: int, prefill_chunk: int = 512) -> None:
        self.free_slots = list(range(num_slots))[::-1]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefill_chunk = prefill_chunk

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot, req.status = self.free_slots.pop(), Status.PREFILL
            self.running.append(req)
        plan = StepPlan([], [])
        budget = self.prefill_chunk  # prompt tokens per step, shared by prefilling slots
        for req in self.running:
            if req.status is Status.DECODE:
                plan.decode.append(req)
            elif budget > 0:
                start = req.n_prefilled
                chunk = req.prompt[start : start + budget]
                budget -= len(chunk)
                plan.prefill.append((req, chunk, start + len(chunk) == len(req.prompt)))
        return plan

    def finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.running.remove(req)
        self.free_slots.append(req.slot)
