"""FlatBatch: the metadata of one forward over several sequences, passed explicitly.

All sequences' new tokens are concatenated into one flat [T] tensor. Sequence i owns rows
cu_seqlens[i]:cu_seqlens[i+1], lives in cache slot slots[i], and its first new token sits at
position starts[i] (the number of tokens already cached for that slot).

keep_states[i] asks recurrent layers to keep the state after every token of sequence i
(snapshots that a rollback can return to); attention layers ignore it.

branches[i] lists the alternatives at the end of sequence i (a verification's [last, d1..dk]
then a1..am), each by the draft token it stands in for (0: d1): a_j sits at that token's
position, attends to the rows before it and to itself only, and is stored after the
sequence's other rows (`rows_at`), where a commit that keeps it moves it into place
(speculative/verify.py `verify_greedy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class FlatBatch:
    slots: list[int]
    starts: list[int]
    cu_seqlens: list[int]
    positions: torch.Tensor  # [T] int64, absolute position of every row
    keep_states: tuple[bool, ...] = ()  # per sequence; empty = none
    branches: tuple[tuple[int, ...], ...] = ()  # per sequence; empty = none

    @classmethod
    def build(
        cls,
        slots: Sequence[int],
        starts: Sequence[int],
        lens: Sequence[int],
        device: torch.device,
        keep_states: Sequence[bool] = (),
        branches: Sequence[Sequence[int]] = (),
    ) -> FlatBatch:
        if not len(slots) == len(starts) == len(lens):
            raise ValueError("slots, starts and lens must have one entry per sequence")
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one batch: {list(slots)}")
        cu = [0]
        for n in lens:
            if n < 1:
                raise ValueError("every sequence in a batch needs at least one token")
            cu.append(cu[-1] + n)
        # one tensor from a list: a draft head's one-row steps paid more for an arange per
        # sequence, their cat and a copy than for the rest of their batch
        pos = [p for s, n in zip(starts, lens, strict=True) for p in range(s, s + n)]
        if keep_states and len(keep_states) != len(slots):
            raise ValueError("keep_states needs one entry per sequence")
        if any(branches):
            if len(branches) != len(slots):
                raise ValueError("branches needs one entry per sequence")
            for s, end, n, at in zip(starts, cu[1:], lens, branches, strict=True):
                if not all(0 <= a < n - len(at) - 1 for a in at):
                    raise ValueError("alternatives need the row they stand in for before them")
                pos[end - len(at) : end] = [s + 1 + a for a in at]
        positions = torch.tensor(pos, dtype=torch.int64, device=device)
        branched = tuple(map(tuple, branches)) if any(branches) else ()
        return cls(list(slots), list(starts), cu, positions, tuple(keep_states), branched)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @cached_property
    def end(self) -> int:
        """One past the last position of any sequence (0 for an empty batch); asked by every
        attention layer of a forward, so worked out once."""
        return max(
            (
                s + b - a
                for s, a, b in zip(self.starts, self.cu_seqlens, self.cu_seqlens[1:], strict=False)
            ),
            default=0,
        )

    @cached_property
    def rows_at(self) -> torch.Tensor:
        """[T] int64: where each row is stored in its slot's cache, its position but for
        alternatives (`branches`), stored after their sequence's other rows."""
        if not self.branches:
            return self.positions
        at = [s + r for s, n in zip(self.starts, self.lens(), strict=True) for r in range(n)]
        return torch.tensor(at, dtype=torch.int64, device=self.positions.device)

    def keeps_states(self, i: int) -> bool:
        """Whether sequence i keeps its per-token recurrent states (snapshots)."""
        return bool(self.keep_states) and self.keep_states[i]

    def lens(self) -> list[int]:
        return [b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:], strict=False)]

    def split_last(self) -> tuple[FlatBatch | None, list[int], FlatBatch]:
        """(the rows before each sequence's last as a batch of their own, None if there are
        none; their row indices here; each sequence's last row as a batch, one row a
        sequence, in order). For a one-layer head, whose rows before the last only store
        their K/V (models/eagle3.py `forward_last`)."""
        lens, ends = self.lens(), set(self.last_rows())
        seqs = [(s, a, n - 1) for s, a, n in zip(self.slots, self.starts, lens, strict=True)]
        seqs = [q for q in seqs if q[2] > 0]
        device = self.positions.device
        before = None
        if seqs:
            slots, firsts, counts = (list(c) for c in zip(*seqs, strict=True))
            before = FlatBatch.build(slots, firsts, counts, device)
        early = [i for i in range(self.num_tokens) if i not in ends]
        starts = [a + n - 1 for a, n in zip(self.starts, lens, strict=True)]
        return before, early, FlatBatch.build(self.slots, starts, [1] * len(lens), device)

    def last_rows(self) -> list[int]:
        """Row index of each sequence's last token (whose logits predict the next one)."""
        return [c - 1 for c in self.cu_seqlens[1:]]


@dataclass
class SlotInput:
    """One slot's share of a step: new tokens, and logits wanted for its last n_logits rows."""

    slot: int
    tokens: list[int]
    n_logits: int = 1
    # a verification: the slot may be cut back to any of these tokens when it commits
    verify: bool = False
    # the last tokens' draft tokens they are alternatives to (FlatBatch `branches`)
    branches: tuple[int, ...] = ()
