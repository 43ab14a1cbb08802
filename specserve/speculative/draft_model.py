"""`draft`: a small model with the target's vocabulary proposes tokens.

It keeps its own memory slots (one per target slot). Each step it first catches up with
the tokens the target emitted since last time (rolling its memory back to the longest
prefix it still shares with the slot's context, so rejected draft tokens are forgotten;
a hybrid draft model, whose recurrent state cannot be truncated, goes back to the
checkpoint it took after the previous catch-up and re-feeds from there), then drafts
greedily: one forward per draft position, all drafting slots batched together.
A slot stops at n_max, or before a token whose draft probability is below p_min
(llama.cpp's rule); drafts shorter than n_min are dropped by the base class.
A slot's draft memory outlives its request, as the target's prompt cache does: the next
request in the slot catches up from the prefix they share (a follow-up turn, a system
prompt).

Drafts are the draft model's argmax, so they carry no probabilities: verification samples
the target at each position and accepts while it agrees. That keeps speculation on ==
speculation off token for token at any temperature (see speculative/verify.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from specserve.batch import SlotInput
from specserve.speculative.base import Draft, DraftRequest, Speculator
from specserve.speculative.picks import likeliest
from specserve.tokens import shared_prefix


class DraftMemory(Protocol):
    def length(self, slot: int) -> int: ...
    def nbytes_of(self, slot: int) -> int: ...
    def restorable(self, slot: int, n: int) -> int: ...
    def checkpoint(self, slot: int) -> None: ...
    def commit(self, slot: int, n_keep: int) -> None: ...
    def free(self, slot: int) -> None: ...


class DraftRunner(Protocol):
    """What the speculator drives: the engine's ModelRunner over the draft model."""

    @property
    def memory(self) -> DraftMemory: ...

    def forward(self, work: list[SlotInput]) -> list[torch.Tensor]: ...
    def save(self, slot: int) -> Any: ...
    def restore(self, slot: int, saved: Any) -> None: ...


class DraftModelSpeculator(Speculator):
    name = "draft"
    # every token it drafts had at least p_min (0.75 by default) of its probability, so its
    # rates start from what that promises, as a head's classes do (mtp.py), not from 1 in 2:
    # from 1 in 2 the 1.5B's chain verified its head's drafts over the draft model's for
    # its first steps, and kept none of them (docs/perf/2026-11-28-draft-int4.md)
    prior = 0.8

    def __init__(self, runner: DraftRunner, relative_cost: float, prefill_chunk: int = 512) -> None:
        """relative_cost: one draft forward's cost in target forwards (about the size ratio)."""
        super().__init__()
        self.runner = runner
        self.relative_cost = relative_cost
        self.prefill_chunk = prefill_chunk
        self._fed: dict[int, list[int]] = {}  # tokens whose state the draft memory holds

    def save_state(self, slot: int) -> tuple[object, int]:
        """The draft memory of the slot and the tokens it holds: a restored conversation
        drafts at once instead of re-feeding its history to the draft model."""
        fed = self._fed.get(slot)
        if not fed:
            return None, 0
        n = self.runner.memory.length(slot)
        fed = fed[:n]
        return (list(fed), self.runner.save(slot)), self.runner.memory.nbytes_of(slot)

    def restore_state(self, slot: int, state: object) -> None:
        if not isinstance(state, tuple) or len(state) != 2:
            raise TypeError("a draft model restores (tokens, saved slot)")
        fed, saved = state
        self.runner.restore(slot, saved)
        self._fed[slot] = list(fed)

    def _catch_up(self, req: DraftRequest) -> list[int]:
        """Roll the slot back to what it shares with the context; return the tokens to feed
        (at least the newest one, whose logits propose the first draft token)."""
        fed = self._fed.setdefault(req.slot, [])
        keep = min(shared_prefix(fed, req.tokens), len(req.tokens) - 1)
        # a recurrent draft model returns to its checkpoint (set after the last catch-up)
        # and re-feeds the tokens after it; attention-only ones truncate right at `keep`
        keep = self.runner.memory.restorable(req.slot, keep)
        self.runner.memory.commit(req.slot, keep)
        del fed[keep:]
        todo = list(req.tokens[keep:])
        # long catch-ups (a new prompt) go in chunks, as the target's prefill does
        while len(todo) > self.prefill_chunk:
            chunk, todo = todo[: self.prefill_chunk], todo[self.prefill_chunk :]
            self.runner.forward([SlotInput(req.slot, chunk, 0)])
            fed.extend(chunk)
        return todo

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = {r.slot: Draft() for r in requests}
        limits = {r.slot: (r.n_max, r.p_min) for r in requests}
        work = [SlotInput(r.slot, self._catch_up(r), 1) for r in requests if r.n_max > 0]
        caught_up = False
        while work:
            logits = self.runner.forward(work)
            if not caught_up:  # next step rolls back no further than this
                for w in work:
                    self.runner.memory.checkpoint(w.slot)
                caught_up = True
            nxt = []
            for w, lg in zip(work, logits, strict=True):
                self._fed[w.slot].extend(w.tokens)
                tok, p = likeliest(lg[-1])
                n_max, p_min = limits[w.slot]
                if p < p_min:
                    continue
                # no runners-up (verify.py `verify_greedy`): above p_min they are unlikely,
                # and ranking the target's whole vocabulary for them cost the 1.5B's chain
                # more than they gave (docs/perf/2026-12-04-alternatives.md)
                drafts[w.slot].tokens.append(tok)
                if len(drafts[w.slot]) < n_max:
                    nxt.append(SlotInput(w.slot, [tok], 1))
            work = nxt
        return [drafts[r.slot] for r in requests]
