"""What a costly drafter's asks cost (speculative/draft_length.py DraftWorth.priced): the time
each ask really takes, in steps of the forward measured beside it, in place of its prior."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from specserve.speculative.base import Draft, DraftRequest
from specserve.speculative.cost import ForwardCost
from specserve.speculative.draft_length import PRICED, DraftBudget, DraftWorth
from tests.speculative.test_cost import Fixed, teach
from tests.speculative.test_forward_cost import measured


class Slow(Fixed):
    """A costly drafter that takes at least `seconds` per ask, whatever its prior says."""

    def __init__(self, tokens: list[int], prior: float, seconds: float) -> None:
        super().__init__(tokens, "slow", cost=prior)
        self.seconds = seconds

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        time.sleep(self.seconds)
        return super()._draft(requests)


def test_a_costly_drafter_is_priced_by_its_measured_asks_not_its_prior() -> None:
    # its prior (0.1 step a token) says a half-kept token pays; each ask really takes at
    # least 20 plain steps' time, and once PRICED asks show it, it is no longer asked
    spec = Slow([1], prior=0.1, seconds=0.02)
    teach(spec, slot=0, n_accepted=1, times=10, n_max=1)  # half its first tokens kept
    teach(spec, slot=0, n_accepted=0, times=10, n_max=1)
    asks = [DraftRequest(0, [0], 1, cost=[1.0, 1.1], step_seconds=0.001) for _ in range(3)]
    assert spec.worth.draft_cost == 0.1  # asks without a measured step leave the prior
    asked = []
    for req in asks + asks:
        before = spec.asked
        spec.draft([req])
        spec.accept(0, 0 if spec.asked == before else 1)
        asked.append(spec.asked - before)
    assert asked[:PRICED] == [1] * PRICED and asked[PRICED:] == [0] * (6 - PRICED)
    assert spec.worth.draft_cost >= 20


def _priced(worth: DraftWorth, seconds: float, n: int, made: int, unit: float | None) -> None:
    """One ask on slot 0, its context n tokens long, for 2 tokens; `made` drafted."""
    worth.priced(seconds, [DraftRequest(0, [0] * n, 2, step_seconds=unit)], [Draft([1] * made)])


def test_a_price_counts_every_position_run_and_holds_still_as_the_machine_drifts() -> None:
    worth = DraftWorth(Fixed([], cost=0.2))
    _priced(worth, 0.5, n=10, made=0, unit=0.05)  # a first ask: it caught up over the prompt
    _priced(worth, 0.010, n=11, made=1, unit=0.050)  # a token and one under p_min: 2 runs
    _priced(worth, 0.020, n=12, made=2, unit=0.100)  # the VM at half speed, ask and step alike
    assert worth.draft_cost == 0.2  # the prior, until PRICED asks are in
    _priced(worth, 0.1, n=15, made=0, unit=0.050)  # the step before added 3: its price is 2
    assert worth.draft_cost == pytest.approx(0.1)  # the median of 0.1, 0.1, 2
    _priced(worth, 1.0, n=15, made=0, unit=None)  # a step whose forward was not timed
    assert worth.draft_cost == pytest.approx(0.1)


def test_an_ask_after_a_pause_or_in_a_new_sequence_is_not_priced() -> None:
    # each of these catches up over more than the step before added: priced at that, a
    # drafter declined once looked dearer at every revisit and was never asked again
    worth = DraftWorth(Fixed([], cost=0.2))
    for n in (10, 11, 12):
        _priced(worth, 0.01, n, made=2, unit=0.05)  # the second and third are steady
    _priced(worth, 5.0, n=30, made=2, unit=0.05)  # a revisit after 18 tokens
    worth.forget(0)
    _priced(worth, 5.0, n=31, made=2, unit=0.05)  # the slot's next sequence
    assert worth.draft_cost == 0.2  # two asks priced: still the prior
    _priced(worth, 0.01, n=32, made=2, unit=0.05)
    assert worth.draft_cost == pytest.approx(0.1)


def test_the_budget_sends_the_measured_step_with_the_cost() -> None:
    cost = ForwardCost()
    budget = DraftBudget(cost)
    (ask,) = budget.limit([DraftRequest(0, [0], 2)], base_rows=2)
    assert ask.step_seconds is None  # nothing timed yet
    measured(cost, 2, 0.08)
    (ask,) = budget.limit([DraftRequest(0, [0], 2)], base_rows=2)
    assert ask.step_seconds == pytest.approx(0.04)  # one slot's share of the 2-row step
    assert ForwardCost(measure=False).share_seconds(1) is None
