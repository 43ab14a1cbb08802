"""The step's one target forward, timed: its rows' cost feeds the draft cost model
(speculative/cost.py) and its thread count comes from the thread tuner (engine/threads.py).
"""

from __future__ import annotations

import time

import torch

from specserve.batch import SlotInput
from specserve.engine.runner import ModelRunner
from specserve.engine.scheduler import StepPlan
from specserve.engine.threads import ThreadTuner
from specserve.speculative.base import Draft
from specserve.speculative.cost import ForwardCost


class TimedForward:
    def __init__(self, runner: ModelRunner, cost: ForwardCost, threads: ThreadTuner | None):
        self.runner = runner
        self.cost = cost
        self.threads = threads  # None: leave torch's thread setting alone

    def __call__(
        self, plan: StepPlan, drafts: list[Draft]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One forward over the plan's prompt chunks and [last, d1..dk] of each decoding
        slot: (logits of each prompt chunk, logits of each decoding slot)."""
        work = slot_inputs(plan, drafts)
        rows = sum(len(w.tokens) for w in work)
        threads = self.threads.pick(rows) if self.threads else 0
        t0 = time.perf_counter()
        logits = self.runner.forward(work)
        seconds = time.perf_counter() - t0
        if self._measures_verify_cost(plan, rows, threads):
            self.cost.record(rows, seconds)
        if self.threads:
            self.threads.record(rows, threads, seconds)
        n_pre = len(plan.prefill)
        return logits[:n_pre], logits[n_pre:]

    def _measures_verify_cost(self, plan: StepPlan, rows: int, threads: int) -> bool:
        """Whether this forward's time is a sample of what `rows` decode rows cost.

        Not with a prompt chunk in it: prompt rows skip the LM head, so a draft's rows would
        look nearly free beside them. Not on a thread count the tuner only tries: its slower
        forwards would make the rows they carry look dearer than they are."""
        if plan.prefill:
            return False
        return not self.threads or threads == self.threads.best(rows)


def slot_inputs(plan: StepPlan, drafts: list[Draft]) -> list[SlotInput]:
    """The forward's inputs: each prompt chunk, and each decoding slot's [last, d1..dk]
    followed by the draft's alternatives (batch.py `branches`)."""
    work = [SlotInput(r.slot, chunk, int(last)) for r, chunk, last in plan.prefill]
    for req, d in zip(plan.decode, drafts, strict=True):
        tokens = [req.output[-1], *d.tokens, *d.alternatives]
        # with drafts, the slot may be cut back to any of these tokens at commit
        work.append(SlotInput(req.slot, tokens, len(tokens), len(d) > 0, branches=tuple(d.alt_at)))
    return work
