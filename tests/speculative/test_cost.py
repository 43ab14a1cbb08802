"""What a draft is worth: per-slot acceptance, truncation, the chain, whether to ask a costly
drafter (the verify cost: test_forward_cost.py; an ask's price: test_ask_price.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from specserve.speculative.base import Draft, DraftRequest, Speculator
from specserve.speculative.chain import AGREED, CONTESTED, ChainSpeculator
from specserve.speculative.cost import ForwardCost
from specserve.speculative.draft_length import (
    EXPLORE,
    MIN_GAIN,
    REVISIT,
    SPARE_LEAST,
    DraftBudget,
)
from specserve.speculative.rates import ANY


class Fixed(Speculator):
    """Drafts the same tokens for every slot; counts how often it was asked."""

    def __init__(self, tokens: list[int], name: str = "fixed", cost: float = 0.0) -> None:
        super().__init__()
        self.tokens, self.name, self.relative_cost, self.asked = tokens, name, cost, 0

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.asked += len(requests)
        return [Draft(list(self.tokens)) for _ in requests]


def teach(spec: Speculator, slot: int, n_accepted: int, times: int, n_max: int = 4) -> None:
    """`times` verified drafts on `slot`, each keeping n_accepted tokens."""
    for _ in range(times):
        (d,) = spec.draft([DraftRequest(slot, [0], n_max)])  # cost None: never cut
        spec.accept(slot, min(n_accepted, len(d)))


def test_rates_are_per_slot_around_the_overall_rate() -> None:
    spec = Fixed([1, 2, 3, 4])
    teach(spec, slot=0, n_accepted=4, times=20)
    teach(spec, slot=1, n_accepted=0, times=20)
    good, bad = spec.acceptance_rates(0, 4), spec.acceptance_rates(1, 4)
    assert min(good) > 0.85 and max(bad) < 0.15
    # a new sequence on a slot starts from the drafter's overall rate again
    spec.begin(1, [0])
    overall = (20 + 1) / (40 + 2)
    assert spec.acceptance_rates(1, 1) == pytest.approx([overall])


def test_draft_cut_to_the_length_worth_verifying() -> None:
    spec = Fixed([1, 2, 3, 4])
    teach(spec, slot=0, n_accepted=1, times=30)  # position 0 kept, position 1 never
    # the first row costs 0.9 steps, later rows 0.1: only the kept token is worth it
    steep = [1.0, 1.9, 2.0, 2.1, 2.2]
    (d,) = spec.draft([DraftRequest(0, [0], 4, cost=steep)])
    assert (d.tokens, d.source) == ([1], "fixed")  # cut, still named by its drafter
    spec.accept(0, 1)
    # a slot whose drafts all miss gets no draft at all when a row costs nearly a step
    teach(spec, slot=1, n_accepted=0, times=30)
    (d,) = spec.draft([DraftRequest(1, [0], 4, cost=steep)])
    assert d.tokens == []
    spec.accept(1, 0)
    # free rows: every draft is worth verifying whole
    (d,) = spec.draft([DraftRequest(1, [0], 4, cost=[1.0] * 5)])
    assert d.tokens == [1, 2, 3, 4]


def test_costly_drafter_not_asked_where_no_draft_can_pay() -> None:
    spec = Fixed([1, 2], cost=0.5)
    teach(spec, slot=0, n_accepted=0, times=30)
    asked = spec.asked
    (d,) = spec.draft([DraftRequest(0, [0], 2, cost=[1.0, 1.2, 1.4])])
    assert d.tokens == [] and spec.asked == asked
    spec.accept(0, 0)


@pytest.mark.parametrize("in_chain", [False, True])
@pytest.mark.parametrize("kept", [True, False])
def test_an_untried_costly_drafter_is_asked_to_learn_its_rates(kept: bool, in_chain: bool) -> None:
    # the prior's 1 in 2 says a drafter costing 0.5 steps a token cannot pay (the 0.5B
    # draft model for the 1.5B target was never asked); a few one-token asks learn the truth
    drafter = Fixed([1, 2], cost=0.5)
    spec: Speculator = ChainSpeculator([Fixed([], "lookup"), drafter]) if in_chain else drafter
    cost = [1.0, 1.2, 1.4]
    got = []
    for _ in range(EXPLORE + 4):
        (d,) = spec.draft([DraftRequest(0, [0], 2, cost=cost)])
        got.append(len(d))
        spec.accept(0, len(d) if kept else 0)
    if kept:  # kept from the first: worth whole drafts as soon as that is learnt
        assert got[0] == 1 and got[1:] == [2] * (EXPLORE + 3)
    else:  # every draft missed: asked EXPLORE times (later asks' drafts are cut once the
        # misses show), then no more
        assert got[0] == 1 and got[EXPLORE:] == [0] * 4 and drafter.asked == EXPLORE


def _asked_while_always_right(
    spec: Speculator, drafter: Fixed, steps: int, cost: Sequence[float] = (1.0, 1.2)
) -> list[int]:
    """Per step, whether `drafter` was asked, on a text of 1s that it always foresees: a
    verified draft adds its token and the target's, an unverified one the target's. Each
    step asks for as many tokens as `cost` prices."""
    return [n for (n,) in _asks_while_always_right(spec, [drafter], steps, cost)]


def _asks_while_always_right(
    spec: Speculator, drafters: Sequence[Fixed], steps: int, cost: Sequence[float]
) -> list[tuple[int, ...]]:
    """`_asked_while_always_right` for several drafters: per step, whether each was asked."""
    context, asked = [0], []
    for _ in range(steps):
        before = [f.asked for f in drafters]
        (d,) = spec.draft([DraftRequest(0, list(context), len(cost) - 1, cost=cost)])
        asked.append(tuple(f.asked - b for f, b in zip(drafters, before, strict=True)))
        spec.accept(0, len(d))
        context += [1] * (len(d) + 1)
    return asked


@pytest.mark.parametrize("in_chain", [False, True])
def test_a_declined_costly_drafter_is_revisited_and_learns_the_text_changed(
    in_chain: bool,
) -> None:
    """Misses taught it to stop (prose); asked one token now and then, it learns that the
    text turned predictable (code) and is asked every step again, alone or in a chain."""
    head = Fixed([1], "head", cost=0.1)
    teach(head, slot=0, n_accepted=0, times=30)
    spec: Speculator = ChainSpeculator([Fixed([], "lookup"), head]) if in_chain else head
    asked = _asked_while_always_right(spec, head, 40 * REVISIT)
    assert asked[: REVISIT - 1] == [0] * (REVISIT - 1) and asked[REVISIT - 1] == 1
    assert all(asked[-REVISIT:])


def test_chain_verifies_the_draft_worth_most_and_credits_its_drafter() -> None:
    short, long_ = Fixed([7], "short"), Fixed([1, 2, 3, 4], "long")
    teach(long_, slot=0, n_accepted=4, times=10)
    teach(short, slot=0, n_accepted=0, times=10)
    chain = ChainSpeculator([short, long_])
    (d,) = chain.draft([DraftRequest(0, [0], 4, cost=[1.0, 1.2, 1.4, 1.6, 1.8])])
    assert (d.tokens, d.source) == ([1, 2, 3, 4], "long")  # the child's type, not "chain"
    before = long_.stats.tokens_accepted
    chain.accept(0, 4)
    assert long_.stats.tokens_accepted == before + 4
    assert short.stats.tokens_generated == 10  # its losing draft was discarded, not counted


@pytest.mark.parametrize("text", ["code", "prose"])
def test_a_chain_asks_first_the_costly_drafter_that_promises_most(text: str) -> None:
    """A head (cheap, one token half kept) and a draft model (dear, four tokens): on code,
    where the draft model's drafts are kept whole, it is asked first and the head, whose
    draft could not beat them, not at all; on prose the head goes first and alone."""
    head, model = Fixed([1], "head", cost=0.1), Fixed([1, 2, 3, 4], "model", cost=0.45)
    for _ in range(15):
        teach(head, slot=0, n_accepted=1, times=1)
        teach(head, slot=0, n_accepted=0, times=1)
    teach(model, slot=0, n_accepted=4 if text == "code" else 0, times=30)
    chain = ChainSpeculator([head, model])
    asked = head.asked, model.asked
    (d,) = chain.draft([DraftRequest(0, [0], 4, cost=[1.0, 1.15, 1.2, 1.25, 1.3])])
    if text == "code":
        assert (model.asked - asked[1], head.asked - asked[0], d.source) == (1, 0, "model")
    else:
        assert (head.asked - asked[0], model.asked - asked[1], d.source) == (1, 0, "head")


def test_rates_are_products_of_per_position_rates_learnt_where_reached() -> None:
    spec = Fixed([1, 2, 3, 4])
    teach(spec, slot=0, n_accepted=2, times=30, n_max=4)  # positions 0, 1 kept; 2 never
    r = spec.acceptance_rates(0, 4)
    assert r[0] > 0.9 and r[1] > 0.85 and r[2] < 0.1 and r[3] <= r[2]
    # a drafter only ever asked for 2 tokens: positions 2, 3 never reached carry its rate
    short = Fixed([1, 2])
    teach(short, slot=0, n_accepted=2, times=30, n_max=2)
    deep = short.acceptance_rates(0, 4)
    assert deep[3] > 0.8 and deep == sorted(deep, reverse=True)


class Seen(Fixed):
    """A costly drafter that records the n_max it was asked for, and may give nothing."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(tokens, "seen", cost=0.3)
        self.n_max_seen: list[int] = []

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.n_max_seen += [r.n_max for r in requests]
        return super()._draft(requests)


def test_costly_drafter_is_asked_for_the_length_worth_drafting() -> None:
    spec = Seen([1, 2, 3, 4, 5, 6, 7, 8])
    teach(spec, slot=0, n_accepted=2, times=30, n_max=8)  # never past position 1
    spec.n_max_seen.clear()
    flat = [1.0 + 0.1 * k for k in range(9)]
    (d,) = spec.draft([DraftRequest(0, [0], 8, cost=flat)])
    assert spec.n_max_seen == [2] and d.tokens == [1, 2]  # no tokens drafted to be cut
    spec.accept(0, 2)


def test_costly_drafter_giving_nothing_is_asked_less_and_keeps_its_rates() -> None:
    spec = Seen([])
    before = spec.acceptance_rates(0, 1)[0]
    for _ in range(10):
        (d,) = spec.draft([DraftRequest(0, [0], 4, cost=[1.0] * 5)])
        assert d.tokens == []
        spec.accept(0, 0)
    # each empty answer lowers the share of asks that give a draft, until asking is not
    # worth its drafting cost; what it would draft is no worse known than before
    assert spec.worth.yield_rate(0) < 0.5 and 0 < spec.asked < 10
    assert spec.acceptance_rates(0, 1)[0] == before


class UnsureOn(Seen):
    """Gives nothing for the slots in `unsure`, its tokens on the others."""

    def __init__(self, tokens: list[int], unsure: set[int]) -> None:
        super().__init__(tokens)
        self.unsure = unsure

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = super()._draft(requests)
        return [
            Draft() if r.slot in self.unsure else d for r, d in zip(requests, drafts, strict=True)
        ]


def test_the_share_of_asks_that_give_a_draft_is_each_sequences_own() -> None:
    """A slot whose text leaves the drafter unsure (prose) is asked less; another slot's
    text, and the next request in the same slot, are asked as before. Learnt across
    sequences, a server's prose answer held a draft model unasked through the next
    request's C answer."""
    spec = UnsureOn([1, 2, 3, 4], unsure={1})
    teach(spec, slot=0, n_accepted=4, times=20)
    flat = [1.0 + 0.1 * k for k in range(5)]
    for _ in range(10):
        (d,) = spec.draft([DraftRequest(1, [0], 4, cost=flat)])
        assert d.tokens == []
        spec.accept(1, 0)
    assert spec.worth.yield_rate(1) < 0.5 and spec.worth.yield_rate(0) == 1.0
    spec.n_max_seen.clear()
    (d,) = spec.draft([DraftRequest(0, [0], 4, cost=flat)])
    assert spec.n_max_seen == [4] and d.tokens == [1, 2, 3, 4]
    spec.accept(0, 4)
    spec.unsure.clear()
    spec.begin(1, [0])  # slot 1's next request
    assert spec.worth.yield_rate(1) == 1.0
    spec.n_max_seen.clear()
    (d,) = spec.draft([DraftRequest(1, [0], 4, cost=flat)])
    assert spec.n_max_seen == [4] and d.tokens == [1, 2, 3, 4]


class Unsure(Fixed):
    """A costly drafter that gives its tokens on every `every`-th ask, nothing otherwise."""

    def __init__(self, tokens: list[int], every: int) -> None:
        super().__init__(tokens, "unsure", cost=0.1)
        self.every = every

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = super()._draft(requests)
        return [d if self.asked % self.every == 0 else Draft() for d in drafts]


def test_an_unsure_drafter_is_judged_by_the_drafts_it_makes() -> None:
    """Sure once in three asks and then always right: its drafts are worth verifying (kept
    whole, rates near 1) and asking it pays. Had its empty answers counted as misses, its
    first-token rate would be near 1/3 and, a row costing 0.3 steps, every draft cut."""
    spec = Unsure([1], every=3)
    made, verified = 0, 0
    for _ in range(60):
        before = spec.asked
        (d,) = spec.draft([DraftRequest(0, [0], 1, cost=[1.0, 1.3])])
        assert spec.asked == before + 1  # asked every step
        made += spec.asked % spec.every == 0
        verified += len(d)
        spec.accept(0, len(d))
    assert verified == made == 20
    assert spec.acceptance_rates(0, 1)[0] > 0.9
    assert spec.worth.yield_rate(0) == pytest.approx(1 / 3, abs=0.1)


def test_whether_to_ask_reads_the_slots_drafts_of_every_tier() -> None:
    """Tiers 1 (never kept) and 2 (always kept) on slot 0, only tier 1 on slot 1: asking
    is judged per slot by all its drafts, a made draft by its own tier."""
    rates = Fixed([1]).rates
    for _ in range(20):
        rates.learn(0, 1, 0, 1)
        rates.learn(0, 2, 1, 1)
        rates.learn(1, 1, 0, 1)
    slot0, slot1 = rates.rates(0, ANY, 1)[0], rates.rates(1, ANY, 1)[0]
    assert 0.4 < slot0 < 0.6 and slot1 < 0.2
    assert rates.rates(1, 2, 1)[0] > 0.8  # a sure draft on slot 1 by its tier's record


def test_each_drafter_keeps_its_own_draft_limit() -> None:
    """In a chain one slot's limit once followed whichever drafter missed last: a head's
    one-token miss held the draft model to one token."""
    budget = DraftBudget(ForwardCost())
    budget.update(0, 4, 4, 8, "draft")  # kept whole: its limit stays at n_max
    budget.update(0, 3, 0, 8, "suffix")  # missed at once: the suffix drafter's drops to 1
    (ask,) = budget.limit([DraftRequest(0, [0], 8)], base_rows=1)
    assert (ask.n_max, ask.limited("suffix").n_max, ask.limited("draft").n_max) == (8, 1, 8)
    free = replace(ask, cost=None)  # rows are free: drafts are cut by the limits alone
    (d,) = Fixed(list(range(8)), "suffix").draft([free])
    assert len(d) == 1
    chain = ChainSpeculator([Fixed(list(range(8)), "suffix"), Fixed(list(range(8)), "draft")])
    (d,) = chain.draft([free])
    assert (len(d), d.source) == (8, "draft")
    budget.update(0, 8, 1, 8, "draft")
    budget.update(0, 1, 1, 8, "suffix")  # kept whole: doubles
    (ask,) = budget.limit([DraftRequest(0, [0], 8)], base_rows=1)
    assert (ask.limited("suffix").n_max, ask.limited("draft").n_max) == (2, 2)
    budget.reset(0)
    (ask,) = budget.limit([DraftRequest(0, [0], 8)], base_rows=1)
    assert ask.limits == {}


class Tiered(Fixed):
    """A costly drafter sure and right on every other ask (tier 5), unsure and wrong on the
    rest (tier 1): the next token of `truth`, or a token that is never next."""

    def __init__(self, truth: list[int]) -> None:
        super().__init__([], "tiered", cost=0.15)
        self.truth = truth

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.asked += len(requests)
        sure = self.asked % 2 == 0
        return [
            Draft([self.truth[len(r.tokens)]], tier=5) if sure else Draft([-1], tier=1)
            for r in requests
        ]


def test_a_drafter_whose_unsure_drafts_are_dropped_is_judged_by_its_sure_ones() -> None:
    """Half its drafts are kept, but the half it is sure of always are: verifying those
    and dropping the rest pays, though the mean of both would not (a row costs 0.3)."""
    truth = list(range(100, 400))
    spec = Tiered(truth)
    cost = [1.0, 1.3]
    n, steps = 1, []
    for _ in range(80):
        before = spec.asked
        (d,) = spec.draft([DraftRequest(0, truth[:n], 1, cost=cost)])
        kept = int(bool(d) and d.tokens[0] == truth[n])
        spec.accept(0, kept)
        steps.append((spec.asked - before, len(d), kept))
        n += kept + 1
    late = steps[40:]
    assert all(asked for asked, _, _ in late)
    assert sum(v for _, v, _ in late) == 20 and all(k == v for _, v, k in late)  # sure ones
    req = DraftRequest(0, truth[:n], 1, cost=cost)
    mixed = spec.worth._per_step(req, 1, ANY, spec.worth.yield_rate(0), spec.worth.draft_cost)
    assert mixed[1] < MIN_GAIN <= spec.worth.best_value(req)


class Scripted(Speculator):
    """Drafts `script(step)` for every slot, counting its own asks as steps."""

    def __init__(self, name: str, cost: float, script) -> None:  # noqa: ANN001
        super().__init__()
        self.name, self.relative_cost, self.script, self.steps = name, cost, script, 0

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.steps += 1
        return [Draft(list(self.script(self.steps))) for _ in requests]


@pytest.mark.parametrize(("head_says", "tier"), [(7, AGREED), (8, CONTESTED)])
def test_a_free_draft_beside_a_costly_one_is_learnt_by_whether_they_agree(
    head_says: int, tier: int
) -> None:
    lookup = Fixed([7, 7], "lookup")
    chain = ChainSpeculator([lookup, Fixed([head_says], "head", cost=0.05)])
    (d,) = chain.draft([DraftRequest(0, [0], 2, cost=[1.0, 1.05, 1.1])])  # head untried: asked
    chain.accept(0, 0)
    assert lookup.rates.tiers == [tier]


def test_a_lookup_the_head_contradicts_loses_to_the_head_there_and_only_there() -> None:
    """The target always says 7. Every other step the lookup drafts four wrong tokens; the
    head drafts one right token each step. Learnt as one record, the lookup's drafts (half
    of them kept whole) are worth more than the head's one token, so its wrong drafts were
    verified too; learnt apart by agreement, the contested ones go and the head's is
    verified in their place, while the lookup's agreed drafts still win."""
    lookup = Scripted("lookup", 0.0, lambda step: [7] * 4 if step % 2 else [5] * 4)
    head = Scripted("head", 0.05, lambda step: [7])
    chain = ChainSpeculator([lookup, head])
    context, chosen = [0], []
    for _ in range(60):
        req = DraftRequest(0, list(context), 4, cost=[1.0, 1.05, 1.1, 1.15, 1.2])
        (d,) = chain.draft([req])
        kept = next((i for i, t in enumerate(d.tokens) if t != 7), len(d))
        chain.accept(0, kept)
        context += [7] * (kept + 1)
        chosen.append((lookup.steps % 2 == 1, d.source))
    late = chosen[-20:]
    assert {src for right, src in late if right} == {"lookup"}
    assert {src for right, src in late if not right} == {"head"}


def test_a_cheaper_costly_drafter_is_not_asked_where_a_dearer_one_drafted_or_doubted() -> None:
    """A draft model whose drafts are kept promises more than a head and is asked first;
    where its draft stands the head, cheaper, is not asked, not even now and then to
    learn its rates. Where the model, asked, drafts nothing (unsure there), the head is
    not asked either; once the model's empty asks make it not worth asking, the head is
    asked every step again."""
    model = Fixed([1], "model", cost=0.3)
    head = Fixed([1, 1, 1], "head", cost=0.05)
    teach(model, slot=0, n_accepted=1, times=30, n_max=1)
    teach(head, slot=0, n_accepted=1, times=30, n_max=3)
    chain = ChainSpeculator([head, model])
    cost = [1.0, 1.05, 1.1, 1.15]
    assert chain._order([DraftRequest(0, [0], 3, cost=cost)])[0] is model
    assert sum(_asked_while_always_right(chain, head, 4 * REVISIT, cost)) == 0
    model.tokens = []  # unsure of every token: it drafts nothing
    chain.begin(0, [0])
    asked = _asks_while_always_right(chain, [model, head], REVISIT, cost)
    assert asked[0] == (1, 0) and all(m + h == 1 for m, h in asked)
    assert all(h for _, h in asked[-REVISIT // 2 :])


def _asks_in_chain(chain: ChainSpeculator, drafters: Sequence[Fixed], steps: int) -> list[tuple]:
    """Per step, how often each drafter was asked and whose draft was verified (kept whole)."""
    cost = [1.0, 1.15, 1.2, 1.25, 1.3]
    asked = []
    for _ in range(steps):
        before = [f.asked for f in drafters]
        (d,) = chain.draft([DraftRequest(0, [0], 4, cost=cost)])
        asked.append((*(f.asked - b for f, b in zip(drafters, before, strict=True)), d.source))
        chain.accept(0, len(d))
    return asked


def _one_token_head_and_model() -> tuple[Fixed, Fixed]:
    """A head whose rates over four positions were learnt from four-token drafts, now
    drafting one token, and a dearer draft model whose four-token drafts are kept."""
    head, model = Fixed([1, 1, 1, 1], "head", cost=0.05), Fixed([1, 2, 3, 4], "model", cost=0.45)
    for _ in range(15):
        teach(head, slot=0, n_accepted=4, times=1)
        teach(head, slot=0, n_accepted=0, times=1)
    teach(model, slot=0, n_accepted=4, times=30)
    head.tokens = [1]
    return head, model


def test_a_cheaper_drafter_whose_drafts_fall_short_of_a_dearer_ones_promise_goes_behind() -> None:
    """A head that promises more than the draft model by its rates over four positions but
    drafts one token, worth less than the model promises, is asked first until SPARE_LEAST
    of its drafts show that; then the model goes first and the head, outranked, is not
    asked. Ranked by promise alone, the head was asked every step in vain."""
    head, model = _one_token_head_and_model()
    chain = ChainSpeculator([head, model])
    req = DraftRequest(0, [0], 4, cost=[1.0, 1.15, 1.2, 1.25, 1.3])
    promise = {c.name: c.worth.best_value(req, False) for c in (head, model)}
    one = head.worth.value(req, Draft([1]))
    assert promise["head"] > promise["model"] > one
    asked = _asks_in_chain(chain, [head, model], 20)
    assert asked[:SPARE_LEAST] == [(1, 1, "model")] * SPARE_LEAST
    assert asked[SPARE_LEAST:] == [(0, 1, "model")] * (20 - SPARE_LEAST)


def test_a_calibrated_head_whose_classes_fall_short_goes_behind_before_it_drafts() -> None:
    """The same head with a calibration: by its classes' shares and kept rates, most of
    its one-token drafts would be worth less than the model promises, so the model goes
    first from the first step and the head is never asked."""
    head, model = _one_token_head_and_model()
    head.rates.first_rates.update({1: 0.2, 2: 0.5, 3: 0.9})
    head.rates.first_shares = {1: 0.4, 2: 0.3, 3: 0.3}
    chain = ChainSpeculator([head, model])
    req = DraftRequest(0, [0], 4, cost=[1.0, 1.15, 1.2, 1.25, 1.3])
    assert head.worth.best_value(req, False) > model.worth.best_value(req)
    assert head.worth.value(req, Draft([1], tier=3)) > model.worth.best_value(req)
    assert _asks_in_chain(chain, [head, model], 20) == [(0, 1, "model")] * 20


def test_a_cheaper_drafter_whose_drafts_beat_a_dearer_ones_promise_stays_first() -> None:
    """A head whose kept one-token drafts are worth more than a dear draft model promises
    is asked first every step, and its drafts spare the model's asks but its revisits
    (whose longer drafts, made, are worth the most)."""
    head, model = Fixed([1], "head", cost=0.05), Fixed([1, 2, 3, 4], "model", cost=0.8)
    teach(head, slot=0, n_accepted=1, times=30)
    teach(model, slot=0, n_accepted=4, times=30)
    chain = ChainSpeculator([head, model])
    req = DraftRequest(0, [0], 4, cost=[1.0, 1.15, 1.2, 1.25, 1.3])
    assert 1.0 < model.worth.best_value(req) < head.worth.value(req, Draft([1]))
    revisits = [i % REVISIT == REVISIT - 1 for i in range(2 * REVISIT)]
    assert _asks_in_chain(chain, [head, model], 2 * REVISIT) == [
        (1, 1, "model") if revisit else (1, 0, "head") for revisit in revisits
    ]


def test_a_costly_drafter_whose_rates_are_unknown_is_asked_before_a_calibrated_one() -> None:
    """A head whose confidence classes came calibrated promises more than an untried draft
    model by its prior, yet the model, which would be asked anyway to learn its rates, is
    asked first; once it has drafted, the two are ranked by what they promise."""

    class Calibrated(Fixed):
        first_rates = {0: 0.9}

    head, model = Calibrated([1], "head", cost=0.05), Fixed([1, 1], "model", cost=0.3)
    chain = ChainSpeculator([head, model])
    req = DraftRequest(0, [0], 2, cost=[1.0, 1.05, 1.1])
    promise = {c.name: c.worth.best_value(req, False) for c in (head, model)}
    assert promise["head"] > promise["model"] and model.worth.unknown and not head.worth.unknown
    assert chain._order([req])[0] is model
    teach(model, slot=0, n_accepted=0, times=EXPLORE)
    assert not model.worth.unknown and chain._order([req])[0] is head
