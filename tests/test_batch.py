"""FlatBatch: its positions, where it ends, and split_last (the rows before each
sequence's last, and the last rows)."""

from __future__ import annotations

import torch

from specserve.batch import FlatBatch


def test_split_last_parts_a_batch_into_its_earlier_rows_and_its_last() -> None:
    # slot 3 catches up over 3 rows from 10, slot 1 has a single row at 4, slot 0 two from 7
    batch = FlatBatch.build([3, 1, 0], [10, 4, 7], [3, 1, 2], "cpu")
    before, early, last = batch.split_last()
    assert before is not None
    assert (before.slots, before.starts, before.lens()) == ([3, 0], [10, 7], [2, 1])
    assert before.positions.tolist() == [10, 11, 7]
    assert early == [0, 1, 4]
    assert (last.slots, last.starts, last.lens()) == ([3, 1, 0], [12, 4, 8], [1, 1, 1])
    assert last.positions.tolist() == [12, 4, 8]
    assert batch.last_rows() == [2, 3, 5]


def test_a_batch_of_single_rows_has_nothing_before_its_last() -> None:
    batch = FlatBatch.build([0, 1], [5, 9], [1, 1], "cpu")
    before, early, last = batch.split_last()
    assert before is None and early == []
    assert (last.slots, last.starts, last.positions.tolist()) == ([0, 1], [5, 9], [5, 9])


def test_a_batch_ends_past_its_last_position() -> None:
    batch = FlatBatch.build([2, 0], [7, 30], [3, 1], torch.device("cpu"))
    assert batch.positions.tolist() == [7, 8, 9, 30]
    assert batch.end == 31 == int(batch.positions.max()) + 1
