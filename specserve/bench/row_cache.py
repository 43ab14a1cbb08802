"""train-head's target rows kept in RAM for the next epoch (bench/train_head.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from specserve.cache.store import available_memory
from specserve.speculative import head_training as ht

ROW_CACHE_RESERVE = 4 * 2**30  # bytes of RAM the row cache leaves free, whatever its budget


class RowCache:
    """Target rows kept for the next epoch, their tapped states in bfloat16: a sequence seen
    again costs no target forward, nearly half of a step's time. A row is kept only while
    the machine keeps `reserve` bytes free beside it: with the stdlib's text added, a run
    whose rows stayed within the budget outgrew the machine's RAM and was killed
    (docs/perf/2026-11-29-head-stdlib.md)."""

    def __init__(
        self,
        budget: int,
        reserve: int = ROW_CACHE_RESERVE,
        free: Callable[[], int | None] | None = None,
    ) -> None:
        """free: the machine's free bytes (None: unknown); by default what it has now."""
        self.budget, self.used, self.reserve = budget, 0, reserve
        self.free = free or available_memory
        self.rows: dict[int, ht.TargetRows] = {}

    def get(self, i: int, make: Callable[[int], ht.TargetRows]) -> ht.TargetRows:
        if i in self.rows:
            kept = self.rows[i]
            return replace(kept, aux=kept.aux.float())
        rows = make(i)
        soft = [t for t in (rows.soft_ids, rows.soft_p) if t is not None]
        size = rows.aux.numel() * 2 + sum(t.numel() * t.element_size() for t in soft)
        if self.used + size <= self.budget and self._room(size):
            self.rows[i] = replace(rows, aux=rows.aux.to(torch.bfloat16))
            self.used += size
        return rows

    def _room(self, size: int) -> bool:
        """Whether the machine has `size` more bytes beside the reserve (yes where unknown)."""
        free = self.free()
        return free is None or free - size >= self.reserve
