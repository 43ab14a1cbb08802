"""Per-slot draft length that follows measured acceptance.

After a draft is kept whole the slot's limit doubles (up to the request's n_max); after a
miss it drops to what was accepted plus one. Text where drafts keep missing (prose) thus
drafts little and costs little; text that repeats (code edits) quickly drafts long.
"""

from __future__ import annotations


class DraftBudget:
    def __init__(self) -> None:
        self._limit: dict[int, int] = {}

    def limit(self, slot: int, n_max: int) -> int:
        return min(n_max, self._limit.get(slot, n_max))

    def update(self, slot: int, n_proposed: int, n_accepted: int, n_max: int) -> None:
        if n_proposed == 0:
            return
        if n_accepted == n_proposed:
            self._limit[slot] = min(n_max, max(1, 2 * self.limit(slot, n_max)))
        else:
            self._limit[slot] = n_accepted + 1

    def reset(self, slot: int) -> None:
        self._limit.pop(slot, None)
