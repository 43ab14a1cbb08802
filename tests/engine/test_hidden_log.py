"""HiddenLog: the rows of a slot's verifications and replays, cut back as each keeps fewer,
equal to one tensor kept and cut the same way, and copies that later changes leave alone."""

from __future__ import annotations

import random

import torch

from specserve.engine.hidden_log import HiddenLog

D = 3


def rows(at: int, n: int) -> torch.Tensor:
    """n rows whose values name their positions at .. at + n - 1."""
    return torch.arange(at, at + n, dtype=torch.float64)[:, None].expand(n, D).clone()


def test_a_log_equals_one_tensor_added_to_and_cut_the_same_way() -> None:
    rng = random.Random(0)
    log, ref, end = HiddenLog(5), rows(5, 0), 5
    for _ in range(300):
        at = rng.randint(5, end)  # a verification from the end, or a replay from before it
        n = rng.randint(1, 4)
        log.add(at, rows(at, n))
        ref = torch.cat((ref[: at - 5], rows(at, n)))
        end = at + n
        if rng.random() < 0.7:  # a verification kept fewer than it logged
            end = rng.randint(at, end)
            log.keep(end - 5)
            ref = ref[: end - 5]
        assert log.rows == ref.shape[0] == end - 5
    assert torch.equal(log.joined(rows(0, 0)), ref)
    assert torch.equal(ref[:, 0], torch.arange(5, end, dtype=torch.float64))


def test_a_copy_keeps_its_rows_as_the_log_goes_on() -> None:
    log = HiddenLog(0)
    log.add(0, rows(0, 4))
    log.add(4, rows(4, 3))
    saved = log.copy()
    log.keep(5)
    log.add(5, -rows(5, 2))  # other rows at positions 5 and 6
    log.keep(0)
    assert log.rows == 0 and log.joined(rows(0, 0)).shape == (0, D)
    assert torch.equal(saved.joined(rows(0, 0)), rows(0, 7))
    saved.add(2, rows(2, 1))
    assert torch.equal(saved.joined(rows(0, 0)), rows(0, 3))


def test_a_kept_alternatives_row_takes_the_place_of_the_row_it_stood_for() -> None:
    # [last, d1, d2, a1] logged from 4 after two rows from 2: a1 (position 7) goes to 5,
    # in a copy of that chunk (the forward's own rows stay as they were)
    log = HiddenLog(2)
    early = torch.arange(2.0)[:, None]
    step = torch.arange(10.0, 14.0)[:, None]
    log.add(2, early)
    log.add(4, step)
    log.move(7, 5)
    log.keep(4)
    assert log.joined(torch.empty(0, 1))[:, 0].tolist() == [0.0, 1.0, 10.0, 13.0]
    assert step[:, 0].tolist() == [10.0, 11.0, 12.0, 13.0]
