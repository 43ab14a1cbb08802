"""The measured verify cost (speculative/cost.py ForwardCost): k rows' forward time over
one row's, from timings that drift, run scarce or come before serving."""

from __future__ import annotations

import pytest

from specserve.speculative.cost import HORIZON, KEEP, MIN_SAMPLES, PRIOR_PER_ROW, ForwardCost


def measured(cost: ForwardCost, rows: int, seconds: float) -> None:
    for _ in range(MIN_SAMPLES):
        cost.record(rows, seconds)


def test_docstring_example_interpolates_measured_forwards() -> None:
    cost = ForwardCost()
    for rows, ms in ((1, 100), (2, 190), (9, 260)):
        measured(cost, rows, ms / 1e3)
    rel = cost.relative(1, 8)
    assert rel[0] == 1.0
    assert rel[1] == pytest.approx(1.9)
    assert rel[4] == pytest.approx(2.2)
    assert rel[8] == pytest.approx(2.6)


def test_beyond_measured_rows_follows_the_prior_and_median_resists_outliers() -> None:
    cost = ForwardCost()
    for s in (0.1, 0.1, 5.0):  # one interrupted step
        cost.record(1, s)
    assert cost.seconds(1) == pytest.approx(0.1)
    assert cost.seconds(3) == pytest.approx(0.1 * (1 + 2 * PRIOR_PER_ROW))


def test_cost_in_units_of_one_slots_share_with_several_slots() -> None:
    cost = ForwardCost()
    measured(cost, 4, 0.4)
    measured(cost, 6, 0.5)
    # two extra rows add 0.1 s; one slot's share of the 4-row step is 0.1 s
    assert cost.relative(4, 2)[2] == pytest.approx(2.0)


def test_stale_or_scarce_timings_of_a_row_count_give_way_to_the_prior() -> None:
    cost = ForwardCost()
    measured(cost, 5, 0.1)  # a fast spell of the machine, long ago
    for _ in range(HORIZON):
        cost.record(4, 0.2)  # the machine slowed down; 4-row steps only
    # the old 5-row median (0.1) would make an extra row free; the prior holds instead
    assert cost.relative(4, 1)[1] == pytest.approx(1 + 4 * PRIOR_PER_ROW / (1 + 3 * PRIOR_PER_ROW))
    for _ in range(MIN_SAMPLES - 1):
        cost.record(5, 0.3)
    assert cost.relative(4, 1)[1] == pytest.approx(1 + 4 * PRIOR_PER_ROW / (1 + 3 * PRIOR_PER_ROW))
    cost.record(5, 0.3)  # measured lately now
    assert cost.relative(4, 1)[1] == pytest.approx(1 + (0.3 - 0.2) / 0.05)


def test_a_drift_of_the_machine_does_not_make_rare_row_counts_look_cheap() -> None:
    cost = ForwardCost()
    for _ in range(KEEP):  # a fast spell: 4 rows 0.2 s, a fifth row adds a slot's share
        cost.record(4, 0.2)
        cost.record(5, 0.25)
    assert cost.relative(4, 1)[1] == pytest.approx(2.0)
    for _ in range(2 * KEEP):  # the machine is 1.5x slower, and only 4-row steps run
        cost.record(4, 0.3)
    # the 5-row timings (0.25 s) are older than the 4-row ones (0.3 s); compared as taken,
    # the fifth row would look free and every draft be verified
    assert cost.relative(4, 1)[1] == pytest.approx(2.0, rel=0.02)
    assert cost.seconds(5) == pytest.approx(0.375, rel=0.02)


def test_seeded_timings_price_rows_before_serving_and_stay_where_rare() -> None:
    calls: list[int] = []

    def time_rows(n: int) -> float:
        calls.append(n)
        return 1.0 if len(calls) == 1 else (9 + n) / 100  # a cold first forward

    cost = ForwardCost()
    cost.seed(time_rows, (1, 2, 3, 5, 9))
    assert calls == [1] + [1, 2, 3, 5, 9] * MIN_SAMPLES  # in turn; the cold one not kept
    cost.seed(time_rows, (1, 2))  # a second engine sharing the cost seeds it no more
    assert len(calls) == 1 + 5 * MIN_SAMPLES
    assert cost.relative(1, 8) == pytest.approx([1 + k / 10 for k in range(9)])
    # a run that verifies a draft in every step times no plain step: the one-row price
    # still stands on the seeded timings, the common row count's on its own
    for _ in range(2 * KEEP):
        cost.record(2, 0.11)
    assert cost.relative(1, 1) == pytest.approx([1.0, 1.1])
    assert cost.seconds(1) == pytest.approx(0.10)
    unmeasured = ForwardCost(measure=False)
    unmeasured.seed(time_rows)
    assert len(calls) == 1 + 5 * MIN_SAMPLES  # nothing timed


def test_unmeasured_cost_ignores_timings() -> None:
    cost = ForwardCost(measure=False)
    cost.record(1, 1.0)
    cost.record(2, 100.0)
    assert cost.relative(1, 2) == pytest.approx([1.0, 1 + PRIOR_PER_ROW, 1 + 2 * PRIOR_PER_ROW])
