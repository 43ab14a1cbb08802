"""How likely each position of a draft is to be kept: learnt per drafter, tier and slot.

A drafter's rates decide whether a draft is worth verifying (draft_length.py). One
average per drafter judges a confident draft by the record of doubtful ones: the suffix
drafter's drafts are kept far more often after a long match than after a 1-token one
(figures: docs/perf/cost.md). So a drafter labels each draft with a `tier` (Draft.tier, its
own confidence class) and rates are learnt per tier, each starting from the drafter's
overall rate:

    q_all(i)  = (kept_i + 2 q_all(i-1)) / (reached_i + 2)      q_all(-1) = the prior
    q_tier(i) = (tier kept_i + TIER_PRIOR q_all(i)) / (tier reached_i + TIER_PRIOR)
    q(i)      = (slot's tier kept_i + SLOT_PRIOR q_tier(i)) / (... reached_i + SLOT_PRIOR)
    r(i)      = q(0) * ... * q(i)     the chance positions 0..i are all kept

The prior is 1/2, or what a drafter's tokens promise where each had to pass a probability
(a draft model's, p_min: `Speculator.prior`). A drafter whose tiers are its own
probabilities (a head's: mtp.py) gives each tier's first position its class's probability
as the prior in place of q_all(0) (`first_rates`); an EAGLE-3 head whose training measured
how often each class was kept gives that, and its later tokens' kept share as the prior
(eagle3.py `calibrated_rates`).
From the overall rate, a fresh engine verified a head's unsure drafts until their misses
were learnt, and drafting them cost more than the few it kept (docs/perf/2026-11-28-
eagle3-python.md).

Whether to ask a costly drafter at all is judged before its draft shows a tier, so by how
its drafts split among tiers (`tier_shares`, draft_length.py) or by the rates of its drafts
of every tier (`ANY`: the overall rates, then the slot's own).

"reached" counts drafts whose position i the target got to (every earlier one kept). Per
slot because one request (a code edit) is far more predictable than another (prose).

Every draft teaches every position, as made and whether verified or not (`hold` /
`settle`): the target's own next tokens say how many of its tokens it would have kept.
Learnt from its first token alone, a tier whose estimate fell below what a verify row
costs was never verified again, so never learnt better: at 4 slots, where a row costs
most of a slot's step, no draft ever passed the prior's 1 in 2 (figures:
docs/perf/cost.md). Learnt from the verified part alone, a tier whose later positions
missed a few times was cut to one token from then on, and its later positions were
never reached again: the 1.5B's suffix drafts on prose stayed one token long while
ngram-map-k verified the repeats (docs/perf/2026-11-30-settled-drafts.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

TIER_PRIOR = 4  # a tier's rates start from the drafter's overall ones, worth this many drafts
SLOT_PRIOR = 4  # a slot's rates start from its tier's, worth this many drafts
# the tier of a draft not yet made: whether to ask a drafter is judged before it says how
# sure it is, so by its drafts of every tier (overall, then the slot's of every tier)
ANY = -1


def grow(counts: list[int], n: int) -> None:
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))


def count_positions(counts: list[int], n: int, start: int = 0) -> None:
    """One more occurrence of positions start..n-1."""
    grow(counts, n)
    for i in range(start, n):
        counts[i] += 1


def count_kept(
    kept: list[int], reached: list[int], n_kept: int, n_proposed: int, start: int = 0
) -> None:
    """One checked draft into per-position tallies: positions 0..n_kept-1 were kept, and
    the target reached one past them unless all were kept; those before `start` are
    counted already."""
    count_positions(kept, n_kept, start)
    count_positions(reached, min(n_kept + 1, n_proposed), start)


def at(counts: list[int], i: int) -> int:
    return counts[i] if i < len(counts) else 0


@dataclass
class Tally:
    """Per position: drafts whose position i was kept, and that the target reached."""

    kept: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)

    def add(self, n_kept: int, n_proposed: int, start: int = 0) -> None:
        count_kept(self.kept, self.reached, n_kept, n_proposed, start)

    def rate(self, i: int, prior: float, weight: float) -> float:
        return (at(self.kept, i) + weight * prior) / (at(self.reached, i) + weight)


@dataclass(frozen=True)
class _Held:
    """A draft made at context position `at`, whole (before any cut), not yet settled;
    its positions before `start` were verified, so learnt already."""

    at: int
    tokens: tuple[int, ...]
    tier: int
    start: int = 0

    def kept(self, context: Sequence[int]) -> int | None:
        """How many of its tokens the target's output keeps, once `context` shows it (the
        first wrong one, or all of them); None while it cannot tell yet."""
        seen = context[self.at : self.at + len(self.tokens)]
        n = next((i for i, t in enumerate(seen) if t != self.tokens[i]), len(seen))
        return n if n < len(seen) or len(seen) == len(self.tokens) else None


class AcceptanceModel:
    """The rates of one drafter (module docstring)."""

    def __init__(
        self,
        first_rates: Mapping[int, float] | None = None,
        prior: float = 0.5,
        first_shares: Mapping[int, float] | None = None,
    ) -> None:
        """first_rates: tier -> the prior of that tier's first position; prior: q_all(-1)
        (the module doc); first_shares: tier -> the share of its first draft tokens a
        calibrated head made in that tier on held-out text."""
        self.first_rates = dict(first_rates or {})
        self.prior = prior
        self.first_shares = dict(first_shares or {})
        self.overall = Tally()
        self._tiers: dict[int, Tally] = {}
        self._slots: dict[int, dict[int, Tally]] = {}  # slot -> tier -> the sequence's drafts
        self._held: dict[int, list[_Held]] = {}  # slot -> its drafts not yet settled

    def learn(self, slot: int, tier: int, n_kept: int, n_proposed: int, start: int = 0) -> None:
        """A draft of n_proposed tokens on `slot` had its first n_kept kept (its positions
        before `start` counted already)."""
        tallies = [self.overall, self._tier(tier), self._slot(slot, tier)]
        if tier != ANY:
            tallies.append(self._slot(slot, ANY))
        for tally in tallies:
            tally.add(n_kept, n_proposed, start)

    def verified(self, slot: int, tier: int, n_kept: int, n_proposed: int) -> None:
        """The slot's last draft, cut to n_proposed tokens, had n_kept of them kept: learnt
        now; its whole stays held past them where all were kept (`settle`)."""
        self.learn(slot, tier, n_kept, n_proposed)
        held = self._held.get(slot)
        if not held:
            return
        if n_kept < n_proposed or len(held[-1].tokens) <= n_proposed:
            held.pop()
        else:
            held[-1] = replace(held[-1], start=n_proposed)

    def rates(self, slot: int, tier: int, n: int) -> list[float]:
        """r(0)..r(n-1) for a draft of this tier (ANY: of whatever tier) on this slot."""
        by_tier = self._tiers.get(tier, Tally())
        by_slot = self._slots.get(slot, {}).get(tier, Tally())
        rates: list[float] = []
        q_all, r = self.prior, 1.0
        for i in range(n):
            q_all = self.overall.rate(i, q_all, 2)
            prior = self.first_rates.get(tier, q_all) if i == 0 else q_all
            q_tier = by_tier.rate(i, prior, TIER_PRIOR)
            r *= by_slot.rate(i, q_tier, SLOT_PRIOR)
            rates.append(r)
        return rates

    def tier_shares(self, slot: int) -> dict[int, float]:
        """How the drafts to come on `slot` will likely split by tier: the slot's own drafts
        so far, SLOT_PRIOR drafts' worth of every slot's. Empty before any draft."""
        seen = {t: at(tally.reached, 0) for t, tally in self._tiers.items()}
        total = sum(seen.values())
        if not total:
            return {}
        own = self._slots.get(slot, {})
        weights = {
            t: at(own.get(t, Tally()).reached, 0) + SLOT_PRIOR * n / total for t, n in seen.items()
        }
        whole = sum(weights.values())
        return {t: w / whole for t, w in weights.items()}

    @property
    def tiers(self) -> list[int]:
        """The tiers of the drafts learnt from so far."""
        return sorted(self._tiers)

    def hold(self, slot: int, context_len: int, tokens: Sequence[int], tier: int) -> None:
        """A draft made after `context_len` tokens, whole: learnt once the target's output
        shows how much of it holds (`settle`), in place of one held before at the same
        position (a chain's relabelling). An empty draft teaches nothing."""
        held = [h for h in self._held.get(slot, []) if h.at != context_len]
        if tokens:
            held.append(_Held(context_len, tuple(int(t) for t in tokens), tier))
        self._held[slot] = held

    def settle(self, slot: int, context: Sequence[int]) -> None:
        """The slot's context has grown: learn from each held draft it now settles."""
        waiting = []
        for held in self._held.get(slot, []):
            kept = held.kept(context)
            if kept is None:
                waiting.append(held)
            else:
                self.learn(slot, held.tier, max(kept, held.start), len(held.tokens), held.start)
        self._held[slot] = waiting

    def forget(self, slot: int) -> None:
        """The slot starts another sequence: its own tallies and held draft go."""
        self._slots.pop(slot, None)
        self._held.pop(slot, None)

    def _tier(self, tier: int) -> Tally:
        return self._tiers.setdefault(tier, Tally())

    def _slot(self, slot: int, tier: int) -> Tally:
        return self._slots.setdefault(slot, {}).setdefault(tier, Tally())
