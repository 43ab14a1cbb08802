"""The ledger of a costly drafter's asks: what each saved, and the asks it stops."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from specserve.speculative import ledger
from specserve.speculative.base import Draft, DraftRequest, Speculator
from specserve.speculative.chain import AGREED, ChainSpeculator
from specserve.speculative.draft_length import REVISIT
from specserve.speculative.ledger import EARLY, LEAST, SPAN, STOP_BELOW, AskLedger
from tests.speculative.test_cost import Fixed, teach


def test_an_ask_saves_its_kept_tokens_less_its_rows_its_drafting_and_what_it_displaced() -> None:
    book = AskLedger()
    book.asked(0, paid=0.25)
    book.against(0, 0.5)
    book.offered(0, rows=1.5)
    book.settle(0, kept=2)
    assert (book.asks, book.mean) == (1, pytest.approx(2 - 0.5 - 0.25 - 0.5))
    book.asked(0, paid=0.25)  # never verified: the next ask settles it
    book.asked(0, paid=0.5)
    book.settle(0, None)
    assert book.asks == 3 and book.mean == pytest.approx((0.75 - 0.25 - 0.5) / 3)
    book.settle(0, 1)  # nothing open: nothing to settle
    assert book.asks == 3


def test_the_average_stops_a_drafter_only_over_enough_asks_and_then_follows_the_recent() -> None:
    book = AskLedger()
    for _ in range(LEAST - 1):  # asks that clearly lose: each kept a token, for 1.2 steps
        book.asked(0, paid=0.2)
        book.offered(0, rows=2.0)
        book.settle(0, kept=1)
    assert book.paying(0)  # too few asks to say
    book.asked(0, paid=0.2)
    book.forget(0)  # a new sequence on the slot: its open ask brought nothing
    assert not book.paying(0) and book.mean == pytest.approx(-0.2)
    for _ in range(4 * SPAN):  # a long run of losing asks, then a few that pay
        book.asked(0, paid=0.2)
        book.settle(0, None)
    wins = 0
    while not book.paying(0):
        book.asked(0, paid=0.1)
        book.offered(0, rows=1.1)
        book.settle(0, kept=1)
        wins += 1
    assert 1 < wins <= 4  # a moving average: the long run of misses does not hold it down
    assert book.stops == 1  # it turned below the margin once, and back
    total = -0.2 * (LEAST + 4 * SPAN) + (1 - 0.1 - 0.1) * wins
    assert book.saved == pytest.approx(total)
    assert book.summary() == f"{book.asks} asks saved {total:+.1f} steps, stopped 1x"


def test_a_drafter_about_even_is_not_stopped() -> None:
    """One ask in four keeps two tokens, the others miss: the asks lose a few hundredths
    of a step on average, within what SPAN asks can tell from even, so it is kept asked."""
    book = AskLedger()
    for i in range(4 * SPAN):
        book.asked(0, paid=0.3 if i % 4 == 0 else 0.45)
        if i % 4 == 0:
            book.offered(0, rows=1.5)
            book.settle(0, kept=2)
        else:
            book.settle(0, None)
        assert book.paying(0)
    assert STOP_BELOW < book.mean < 0 and book.stops == 0


class Promising(Fixed):
    """A costly drafter whose rates say its every token is kept, whatever the record says
    (a head calibrated on other text than the request's)."""

    def acceptance_rates(self, slot: int, n: int, tier: int = 0) -> list[float]:
        return [0.95 ** (i + 1) for i in range(n)]


def _asks_per_step(spec: Speculator, drafter: Fixed, steps: int, right: bool) -> list[int]:
    """Per step, whether `drafter` was asked, on a text of 1s; its drafts of 1s are kept
    where `right`, else it drafts 2s."""
    context, asked = [0], []
    drafter.tokens = [1] if right else [2]
    for _ in range(steps):
        before = drafter.asked
        (d,) = spec.draft([DraftRequest(0, list(context), 1, cost=[1.0, 1.2])])
        asked.append(drafter.asked - before)
        kept = len(d) if right else 0
        spec.accept(0, kept)
        context += [1] * (kept + 1)
    return asked


def _promising(in_chain: bool) -> tuple[Speculator, Promising]:
    head = Promising([2], "head", cost=0.1)
    return (ChainSpeculator([Fixed([], "lookup"), head]) if in_chain else head), head


@pytest.mark.parametrize("in_chain", [False, True])
def test_a_drafter_whose_rates_promise_what_its_asks_never_bring_is_stopped(
    in_chain: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its rates say every ask pays; every draft misses. Without the ledger it is asked in
    every step; with it, after EARLY asks (none kept a token) only to revisit, alone or in
    a chain. When its drafts turn right, the revisits bring it back."""
    steps = 6 * REVISIT
    with monkeypatch.context() as m:
        m.setattr(ledger, "LEAST", 10**9)  # no ledger
        m.setattr(ledger, "EARLY", 10**9)
        assert all(_asks_per_step(*_promising(in_chain), steps, right=False))
    spec, head = _promising(in_chain)
    asked = _asks_per_step(spec, head, steps, right=False)
    assert all(asked[:EARLY]) and sum(asked[EARLY:]) <= (steps - EARLY) // REVISIT + 1
    back = _asks_per_step(spec, head, 16 * REVISIT, right=True)
    assert all(back[-REVISIT:])


def test_each_sequence_is_judged_by_its_own_asks_once_it_has_enough() -> None:
    """Two slots side by side: one's asks pay, the other's lose. Pooled, the paying one
    carries the losing one; each is judged by its own record once it has LEAST asks, and a
    new sequence by the pooled record until then."""
    book = AskLedger()
    for _ in range(LEAST):
        book.asked(0, paid=0.2)
        book.offered(0, rows=1.2)
        book.settle(0, kept=2)
        book.asked(1, paid=0.2)
        book.settle(1, None)
    assert book.mean > 0 and book.paying(0) and not book.paying(1)
    assert book.stops == 1
    book.forget(1)  # a new request on slot 1: no record of its own, so the pooled one
    assert book.paying(1)
    assert book.paying(2)  # a slot never asked on


def test_a_sequence_whose_asks_kept_nothing_is_judged_by_its_own_record_early() -> None:
    """Beside a sequence whose asks pay, one whose asks keep no token is stopped after
    EARLY of them; one whose asks lose as much but kept a token is carried by the pooled
    record until it has LEAST."""
    book = AskLedger()
    for _ in range(LEAST):
        book.asked(0, paid=0.2)
        book.offered(0, rows=1.2)
        book.settle(0, kept=2)
    for i in range(LEAST):
        assert book.paying(1) == (i < EARLY)
        assert book.paying(2) and book.paying(0)
        book.asked(1, paid=0.1)
        book.offered(1, rows=1.2)
        book.settle(1, kept=0)
        book.asked(2, paid=0.1)
        book.offered(2, rows=2.2 if i else 2.0)  # one token kept, for a whole step's rows
        book.settle(2, kept=0 if i else 1)
    assert not book.paying(1) and not book.paying(2)  # its own record, at LEAST
    book.forget(1)  # a new sequence: no record of its own, so the pooled one's
    assert book.paying(1)


def _asks_per_slot(spec: Speculator, drafter: Fixed, steps: int) -> list[list[int]]:
    """Per step, how often `drafter` was asked on slots 0 and 1, decoding side by side a
    text of 1s on both; its drafts of 1s are all kept on slot 0, none on slot 1."""
    contexts: list[list[int]] = [[0], [0]]
    asked: list[list[int]] = [[], []]
    drafter.tokens = [1]
    for _ in range(steps):
        requests = [DraftRequest(s, list(contexts[s]), 1, cost=[1.0, 1.2]) for s in (0, 1)]
        for s, d in enumerate(spec.draft(requests)):
            asked[s].append(int(drafter.worth.asked_for(requests[s])))
            kept = len(d) if s == 0 else 0
            spec.accept(s, kept)
            contexts[s] += [1] * (kept + 1)
    return asked


@pytest.mark.parametrize("in_chain", [False, True])
def test_a_drafter_losing_on_one_slot_is_stopped_there_while_paying_on_another(
    in_chain: bool,
) -> None:
    """Its rates promise every token on both slots; on slot 1 none is kept. It stays asked
    in every step on slot 0 and, after EARLY asks that kept nothing, only revisits slot 1."""
    spec, head = _promising(in_chain)
    steps = 8 * REVISIT
    good, bad = _asks_per_slot(spec, head, steps)
    assert all(good)
    assert all(bad[:EARLY]) and sum(bad[EARLY:]) <= (steps - EARLY) // REVISIT + 1


def test_a_costly_drafter_in_a_chain_is_judged_against_the_draft_it_would_displace() -> None:
    """A lookup's draft stands; a head that promises more is asked, and its ask is settled
    against what the lookup's draft promised once the head agreed with it: it saved only
    what it added to that."""
    lookup, head = Fixed([1], "lookup"), Fixed([1, 1], "head", cost=0.1)
    teach(lookup, slot=0, n_accepted=1, times=4)
    teach(lookup, slot=0, n_accepted=0, times=4)
    teach(head, slot=0, n_accepted=2, times=SPAN - 4, n_max=2)  # a plain mean
    chain = ChainSpeculator([lookup, head])
    cost = [1.0, 1.1, 1.2]
    req = DraftRequest(0, [0], 2, cost=cost)
    standing = lookup.worth.value(req, Draft([1], tier=AGREED))
    (d,) = chain.draft([req])
    assert d.source == "head"
    before = head.worth.ledger.mean * head.worth.ledger.asks
    chain.accept(0, 2)
    saved = head.worth.ledger.mean * head.worth.ledger.asks - before
    paid = head.worth.draft_cost * 2  # two positions run: it drafted both it was asked for
    assert saved == pytest.approx(2 - (cost[2] - 1) - paid - (standing - 1) * cost[1])


class Empty(Speculator):
    name, relative_cost = "unsure", 0.2

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft() for _ in requests]


def test_an_ask_that_drafted_nothing_paid_for_nothing() -> None:
    spec = Empty()
    for _ in range(3):
        (d,) = spec.draft([DraftRequest(0, [0], 2, cost=[1.0, 1.1, 1.2])])
        spec.accept(0, 0)
    assert spec.worth.ledger.asks == 3
    assert spec.worth.ledger.mean == pytest.approx(-spec.worth.draft_cost)


class Recorded(Promising):
    """Promising, and records the n_max of each ask."""

    def __init__(self) -> None:
        super().__init__([2, 2, 2], "head", cost=0.1)
        self.n_max_seen: list[int] = []

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.n_max_seen += [r.n_max for r in requests]
        return super()._draft(requests)


def test_a_revisit_the_ledger_alone_called_for_asks_the_whole_length_worth_drafting() -> None:
    """Its worth may be in long drafts (a draft model's), which one token cannot show: where
    its rates say a three-token draft pays, its revisits ask for three."""
    head = Recorded()
    context = [0]
    for _ in range(LEAST + 2 * REVISIT):
        (d,) = head.draft([DraftRequest(0, list(context), 3, cost=[1.0, 1.2, 1.3, 1.4])])
        head.accept(0, 0)
        context.append(1)
    assert not head.worth.ledger.paying(0)
    assert EARLY < len(head.n_max_seen) < EARLY + 3 and set(head.n_max_seen) == {3}


def test_a_benchmark_reports_the_ledgers_of_the_costly_drafters_alone() -> None:
    from specserve.bench.spec_report import ledgers

    head, lookup = Fixed([2], "head", cost=0.1), Fixed([3], "lookup")
    head.worth.ledger.asked(0, paid=0.5)
    head.worth.ledger.settle(0, None)
    want = "head: 1 asks saved -0.5 steps, stopped 0x"
    assert ledgers(ChainSpeculator([lookup, head])) == want
    assert ledgers(head) == want and ledgers(lookup) == "" and ledgers(None) == ""


def test_a_benchmark_reports_a_chains_drafts_child_by_child() -> None:
    from specserve.bench.spec_report import drafters

    lookup, head = Fixed([3], "lookup"), Fixed([2], "head", cost=0.1)
    for kept, proposed in ((0, 2), (1, 1), (0, 3)):
        lookup.stats.record_draft(proposed)
        lookup.stats.record_accept(kept, proposed)
    lookup.stats.draft_seconds = 0.004
    chain = ChainSpeculator([head, lookup])  # cheap first, whatever order they came in
    want = "lookup 3 drafts, 2 missed, 1 kept, 4 ms; head 0 drafts, 0 missed, 0 kept, 0 ms"
    assert drafters(chain) == want
    assert drafters(lookup) == "" and drafters(None) == ""  # a lone one's are the run's


def test_a_summary_since_a_mark_counts_only_the_asks_after_it() -> None:
    book = AskLedger()
    for _ in range(LEAST + 8):  # enough losing asks to stop the drafter once
        book.asked(0, paid=0.5)
        book.settle(0, None)
    mark = book.mark()
    assert book.stops == 1 and not book.paying(0)
    book.asked(0, paid=0.1)
    book.offered(0, rows=1.2)
    book.settle(0, kept=3)
    assert book.summary(since=mark) == "1 asks saved +2.7 steps, stopped 0x"
    assert (
        book.summary() == f"{LEAST + 9} asks saved {2.7 - 0.5 * (LEAST + 8):+.1f} steps, stopped 1x"
    )
