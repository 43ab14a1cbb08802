"""Acceptance rates per tier and slot, and what drafts that were not verified teach."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from specserve.speculative.base import Draft, DraftRequest, Speculator
from specserve.speculative.draft_length import MIN_GAIN
from specserve.speculative.mtp import CONFIDENCE, class_rates, confidence_tier
from specserve.speculative.rates import TIER_PRIOR, AcceptanceModel
from specserve.speculative.suffix import SuffixSpeculator, _tier


def test_tiers_are_learnt_apart_and_a_new_tier_starts_from_the_overall_rate() -> None:
    model = AcceptanceModel()
    for _ in range(40):
        model.learn(slot=0, tier=1, n_kept=1, n_proposed=1)
        model.learn(slot=0, tier=2, n_kept=0, n_proposed=1)
    model.forget(0)  # a new sequence: the slot's own tallies go, the tiers' stay
    sure, doubtful = model.rates(0, 1, 1)[0], model.rates(0, 2, 1)[0]
    assert sure > 0.9 and doubtful < 0.1
    overall = (40 + 1) / (80 + 2)  # the prior's 1 in 2 counts as 2 drafts
    assert model.rates(0, 7, 1) == pytest.approx([overall])
    # a tier's first drafts move it from the overall rate, weighted TIER_PRIOR drafts
    model.learn(slot=5, tier=7, n_kept=0, n_proposed=1)
    model.forget(5)
    expected = TIER_PRIOR * (41 / 83) / (1 + TIER_PRIOR)
    assert model.rates(0, 7, 1)[0] == pytest.approx(expected)


def test_a_held_draft_learns_every_position_the_target_output_shows() -> None:
    model = AcceptanceModel()
    model.hold(0, context_len=3, tokens=[9, 8], tier=4)
    model.settle(0, [1, 2, 3])  # the target has not answered yet: nothing learnt
    model.settle(0, [1, 2, 3, 9])  # its first token holds; the second is not known yet
    assert model.overall.reached == []
    model.settle(0, [1, 2, 3, 9, 8])
    assert (model.overall.kept, model.overall.reached) == ([1, 1], [1, 1])
    model.settle(0, [1, 2, 3, 9, 8, 5])  # settled once only
    assert model.overall.reached == [1, 1]
    model.hold(0, context_len=5, tokens=[7, 6], tier=4)
    model.hold(0, context_len=5, tokens=[5, 6], tier=4)  # relabelled: the second one counts
    model.settle(0, [1, 2, 3, 9, 8, 5, 0])  # its second token is wrong
    assert (model.overall.kept, model.overall.reached) == ([2, 1], [2, 2])


def test_a_verified_draft_learns_past_its_cut_once_the_output_shows_it() -> None:
    model = AcceptanceModel()
    model.hold(0, context_len=1, tokens=[4, 5, 6], tier=2)
    model.verified(0, tier=2, n_kept=1, n_proposed=1)  # cut to one token, kept
    assert (model.overall.kept, model.overall.reached) == ([1], [1])
    model.settle(0, [0, 4, 5, 0])  # the target's own tokens: 5 held, 6 did not
    assert (model.overall.kept, model.overall.reached) == ([1, 1], [1, 1, 1])
    model.hold(0, context_len=4, tokens=[7, 7], tier=2)
    model.verified(0, tier=2, n_kept=0, n_proposed=1)  # missed: nothing past it to learn
    model.settle(0, [0, 4, 5, 0, 3, 7])
    assert (model.overall.kept, model.overall.reached) == ([1, 1], [2, 1, 1])


class Phased(Speculator):
    """Drafts 4 tokens of `truth` whose first is right and, before position `wrong_until`,
    the rest wrong (-1)."""

    def __init__(self, truth: list[int], wrong_until: int) -> None:
        super().__init__()
        self.truth, self.wrong_until = truth, wrong_until

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            t = len(r.tokens)
            whole = self.truth[t : t + 4]
            out.append(Draft(whole if t >= self.wrong_until else whole[:1] + [-1] * 3, tier=1))
        return out


def test_drafts_cut_short_learn_their_later_positions_again_when_the_text_changes() -> None:
    # rows cost 0.15 of a step each: after the early drafts' later tokens missed, drafts are
    # cut to their first token; learnt from verified tokens alone, their later positions
    # were never reached again, and the drafts stayed one token long on text they now fit
    truth = list(range(1000, 1400))
    spec = Phased(truth, wrong_until=60)
    cost = [1.0 + 0.15 * k for k in range(5)]
    got: list[tuple[int, int]] = []
    t = 1
    while t < 200:
        (d,) = spec.draft([DraftRequest(0, truth[:t], 4, cost=cost)])
        kept = next((i for i, tok in enumerate(d.tokens) if tok != truth[t + i]), len(d))
        spec.accept(0, kept)
        got.append((t, len(d)))
        t += kept + 1
    assert [n for at, n in got if 30 <= at < 60] == [1] * len([a for a, _ in got if 30 <= a < 60])
    assert [n for at, n in got if at >= 150] and all(n == 4 for at, n in got if at >= 150)


class Oracle(Speculator):
    """Drafts the true continuation of `truth` (so every first token is right), tier 3."""

    def __init__(self, truth: list[int]) -> None:
        super().__init__()
        self.truth = truth

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft(self.truth[len(r.tokens) : len(r.tokens) + 2], tier=3) for r in requests]


def test_drafts_cut_for_cost_still_teach_until_they_are_worth_verifying() -> None:
    # one row costs 0.7 of a step (4 slots on this CPU): the prior's 1 in 2 is not worth
    # it, so without learning from unverified drafts no draft would ever be verified
    truth = list(range(100, 200))
    spec = Oracle(truth)
    cost = [1.0, 1.7, 2.4]
    got = []
    for t in range(1, 40):
        (d,) = spec.draft([DraftRequest(0, truth[:t], 2, cost=cost)])
        got.append(len(d))
        spec.accept(0, len(d))  # every drafted token is right
    assert got[0] == 0 and got[-1] == 2
    verified = next(i for i, n in enumerate(got) if n)
    assert 0 < verified < 15
    # the statistics count verified drafts only
    assert spec.stats.drafts_generated == sum(n > 0 for n in got)
    assert spec.worth.values(DraftRequest(0, truth, 2, cost=cost), 2, tier=3)[2] >= MIN_GAIN


def test_a_doubtful_tier_is_cut_where_a_sure_one_is_verified() -> None:
    spec = Oracle(list(range(100, 200)))
    for _ in range(30):
        spec.rates.learn(1, tier=3, n_kept=2, n_proposed=2)
        spec.rates.learn(1, tier=5, n_kept=0, n_proposed=2)
    req = DraftRequest(0, [0], 2, cost=[1.0, 1.3, 1.6])
    assert spec.worth.cut_length(req, Draft([1, 2], tier=3)) == 2  # verified whole
    assert spec.worth.cut_length(req, Draft([1, 2], tier=5)) == 0  # not at all


def test_suffix_drafts_carry_the_length_of_their_match_as_tier() -> None:
    spec = SuffixSpeculator()
    prompt = [1, 2, 3, 4, 50, 60, 1, 2, 3]  # "1 2 3" seen before, followed by 4
    spec.begin(0, prompt)
    (d,) = spec.draft([DraftRequest(0, prompt, 8)])
    assert d.tokens[:1] == [4] and d.tier == _tier(3, False)
    spec.accept(0, 0)
    other = [7, 8, 9, 7]  # only "7" repeats
    spec.begin(1, other)
    (d,) = spec.draft([DraftRequest(1, other, 8)])
    assert d.tokens == [8] and d.tier == _tier(1, False)
    spec.accept(1, 0)
    spec.reset(0)  # the global tree learns slot 0's output (none here) ...
    spec.learn([40, 41, 42, 43, 44])  # ... and this text
    fresh = [99, 40, 41]
    spec.begin(2, fresh)
    (d,) = spec.draft([DraftRequest(2, fresh, 8)])
    assert d.tokens[:1] == [42] and d.tier == _tier(2, True)


def test_a_probability_tier_starts_from_its_own_probability() -> None:
    # a head's tiers are classes of its probability (mtp.py): before any is learnt, an
    # unsure class is not worth a verify row where a sure one is
    model = AcceptanceModel(class_rates(CONFIDENCE))
    unsure, sure = confidence_tier(0.1), confidence_tier(0.95)
    assert model.rates(0, unsure, 1)[0] == pytest.approx(0.1)
    assert model.rates(0, sure, 1)[0] == pytest.approx(0.9)
    # later positions and tiers without a class start from the overall rates, as before
    assert model.rates(0, sure, 2)[1] == pytest.approx(0.9 * 0.5)
    assert model.rates(0, 0, 1) == pytest.approx([0.5])
    # the class's own record moves it, weighted TIER_PRIOR drafts
    for _ in range(TIER_PRIOR):
        model.learn(slot=3, tier=unsure, n_kept=1, n_proposed=1)
    model.forget(3)
    assert model.rates(0, unsure, 1)[0] == pytest.approx((TIER_PRIOR + TIER_PRIOR * 0.1) / 8)
    spec = Oracle(list(range(100, 200)))
    spec.rates = AcceptanceModel(class_rates(CONFIDENCE))
    req = DraftRequest(0, [0], 2, cost=[1.0, 1.3, 1.6])
    assert spec.worth.cut_length(req, Draft([1, 2], tier=unsure)) == 0
    assert spec.worth.cut_length(req, Draft([1, 2], tier=sure)) >= 1


def test_a_draft_models_rates_start_from_what_p_min_promises() -> None:
    """Each token a draft model drafts passed p_min: before any is verified its draft is
    worth verifying where the 1-in-2 prior's is not, and its misses still pull it down."""
    from specserve.speculative.draft_model import DraftModelSpeculator

    p = DraftModelSpeculator.prior
    model = AcceptanceModel(prior=p)
    assert model.rates(0, 0, 3) == pytest.approx([p, p * p, p**3])
    assert AcceptanceModel().rates(0, 0, 2) == pytest.approx([0.5, 0.25])
    req = DraftRequest(0, [0], 2, cost=[1.0, 1.5, 1.9])
    fresh, promised = Oracle(list(range(100, 200))), Oracle(list(range(100, 200)))
    promised.rates = AcceptanceModel(prior=p)
    assert fresh.worth.cut_length(req, Draft([1, 2])) == 0
    assert promised.worth.cut_length(req, Draft([1, 2])) == 2
    for _ in range(8):
        model.learn(slot=0, tier=0, n_kept=0, n_proposed=2)
    assert model.rates(0, 0, 1)[0] < 0.2
