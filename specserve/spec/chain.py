"""`chain`: several speculators; per slot and step, the draft worth the most is verified.

llama.cpp's chain takes the first non-empty draft in a fixed order. Here every draft is
scored by the tokens it is expected to yield per unit of cost, from its drafter's measured
acceptance at each draft position:

    value(k) = (1 + sum_{i < k} r_i) / (1 + (c + VERIFY_COST) * k)

r_i is the drafter's rate of acceptance at position i (with a prior of 1 kept in 2 tried,
so an untried drafter gets tried), c its drafting cost per token in target forwards, and
the 1s are the target's own token and forward. No draft is worth 1. Cheap drafters are
asked first; a costly one (a draft model) is asked only for slots where it could beat
the best draft so far.
"""

from __future__ import annotations

from collections.abc import Sequence

from specserve.spec.base import Draft, DraftRequest, Speculator

# what one extra verified row costs, in target forwards: `specserve bench decode` on this
# project's AVX2 CPU measured a float32 forward over 8 tokens at 2.1-2.6x one token, i.e.
# about 0.2 per row (bf16 ~0.6; a GPU ~0.01). Too low a value lets short, mostly rejected
# drafts win over long ones.
VERIFY_COST = 0.2


def acceptance_rates(spec: Speculator, n: int) -> list[float]:
    """r_0..r_{n-1}: per-position acceptance of the drafter, with a (1 of 2) prior."""
    acc, prop = spec.stats.accepted_per_pos, spec.stats.proposed_per_pos
    return [
        ((acc[i] if i < len(acc) else 0) + 1) / ((prop[i] if i < len(prop) else 0) + 2)
        for i in range(n)
    ]


def draft_value(spec: Speculator, k: int) -> float:
    cost = getattr(spec, "relative_cost", 0.0)
    return (1 + sum(acceptance_rates(spec, k))) / (1 + (cost + VERIFY_COST) * k)


def best_value(spec: Speculator, n_max: int) -> float:
    """The most a draft of up to n_max tokens from `spec` is expected to be worth."""
    return max((draft_value(spec, k) for k in range(1, n_max + 1)), default=1.0)


class ChainSpeculator(Speculator):
    name = "chain"

    def __init__(self, children: Sequence[Speculator]) -> None:
        super().__init__()
        if not children:
            raise ValueError("a chain needs at least one speculator")
        # cheap drafters first, so costly ones are asked only where they can still win
        self.children = sorted(children, key=lambda s: getattr(s, "relative_cost", 0.0))
        self._chosen: dict[int, Speculator] = {}

    @property
    def relative_cost(self) -> float:
        return max(getattr(s, "relative_cost", 0.0) for s in self.children)

    def serves(self, types: tuple[str, ...] | None) -> bool:
        return any(s.serves(types) for s in self.children)

    def _begin(self, slot: int, prompt: Sequence[int]) -> None:
        for s in self.children:
            s.begin(slot, prompt)

    def _reset(self, slot: int) -> None:
        self._chosen.pop(slot, None)
        for s in self.children:
            s.reset(slot)

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        best = {r.slot: (1.0, Draft()) for r in requests}
        for r in requests:
            self._chosen.pop(r.slot, None)
        for child in self.children:
            costly = getattr(child, "relative_cost", 0.0) > 0
            asks = [
                r for r in requests if not costly or best_value(child, r.n_max) > best[r.slot][0]
            ]
            if not asks:
                continue
            for req, d in zip(asks, child.draft(asks), strict=True):
                value = draft_value(child, len(d)) if d else 0.0
                if value > best[req.slot][0]:
                    if req.slot in self._chosen:
                        self._chosen[req.slot].discard(req.slot)
                    best[req.slot] = (value, d)
                    self._chosen[req.slot] = child
                else:
                    child.discard(req.slot)
        return [best[r.slot][1] for r in requests]

    def _accept(self, slot: int, n_accepted: int, n_proposed: int) -> None:
        chosen = self._chosen.pop(slot, None)
        if chosen is not None:
            chosen.accept(slot, n_accepted)
