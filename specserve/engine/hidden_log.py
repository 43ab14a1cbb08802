"""A slot's hidden states not yet taken by the speculator that drafts from them (mtp, eagle3).

The runner logs each forward's rows for the slot (a copy of that forward's rows alone), cuts
the log back when a verification keeps fewer tokens, and joins it when the speculator takes
it. The rows stay as each forward's chunk until then: joined at every forward, the log of a
slot whose head went unasked was copied whole each step, a cost growing with the answer
(docs/perf/2026-11-30-hidden-log.md).
"""

from __future__ import annotations

import torch


class HiddenLog:
    """Rows for positions first .. first + rows - 1, as chunks never written in place."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.rows = 0
        self._chunks: list[torch.Tensor] = []

    def add(self, at: int, rows: torch.Tensor) -> None:
        """Rows for positions at .. at + len(rows) - 1 (at >= first), replacing any the log
        held from `at` on (a replay)."""
        self.keep(at - self.first)
        self._chunks.append(rows)
        self.rows += rows.shape[0]

    def move(self, src: int, dst: int) -> None:
        """Row of position src in place of the row of position dst, in a copy of dst's chunk
        (an alternative kept: batch.py `branches`)."""
        i, a = self._locate(src - self.first)
        j, b = self._locate(dst - self.first)
        chunk = self._chunks[j] = self._chunks[j].clone()
        chunk[b] = self._chunks[i][a]

    def _locate(self, row: int) -> tuple[int, int]:
        """(chunk, row in it) of the log's row `row`."""
        left = row
        for i, chunk in enumerate(self._chunks):
            if left < chunk.shape[0]:
                return i, left
            left -= chunk.shape[0]
        raise IndexError(f"the log holds {self.rows} rows, not row {row}")

    def keep(self, n: int) -> None:
        """Keep the first n rows (a verification kept fewer tokens than it logged)."""
        while self._chunks and self.rows - self._chunks[-1].shape[0] >= n:
            self.rows -= self._chunks.pop().shape[0]
        if self.rows > n:
            last = self._chunks[-1]
            self._chunks[-1] = last[: last.shape[0] - (self.rows - n)]
            self.rows = n

    def joined(self, empty: torch.Tensor) -> torch.Tensor:
        """The rows as one tensor [rows, D] (`empty`, [0, D], where there are none)."""
        if len(self._chunks) == 1:  # never written in place: itself, not a copy
            return self._chunks[0]
        return torch.cat(self._chunks) if self._chunks else empty

    def copy(self) -> HiddenLog:
        """A log of the same rows that later adds and cuts to either leave alone."""
        other = HiddenLog(self.first)
        other.rows, other._chunks = self.rows, list(self._chunks)
        return other
