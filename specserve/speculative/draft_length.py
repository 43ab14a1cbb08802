"""How long a draft is: decided here, in two halves that a step runs in turn.

1. The engine's half, `DraftBudget`: each drafter may draft up to its own limit per slot,
   which follows its measured acceptance. After its draft is kept whole the limit doubles
   (up to the request's n_max); after a miss it drops to what was accepted plus one. Text
   where drafts keep missing (prose) thus drafts little; text that repeats (code edits)
   quickly drafts long. Per drafter because in a chain one slot's limit was cut by
   whichever drafter missed last: a head's one-token miss held the draft model to one
   token, and it took three kept drafts to ramp back up.
   With the limits goes cost[k], what verifying k draft rows costs this step in plain
   steps (`ForwardCost`, cost.py).
2. Each drafter's half, `DraftWorth`: a k-token draft it made is worth

       value(k) = (1 + sum_{i<k} r_i) / cost(k)

   tokens per step-equivalent, r_i being the chance that positions 0..i of the draft are
   all kept (rates.py, per tier); no draft is worth 1. A drafter that pays per token is
   asked, before it drafts, for the length worth the most with its drafting counted:

       ask(k) = (1 + y sum_{i<k} r_i) / ((1 - y) cost(0) + y cost(k) + c * k)

   with c its cost per draft token in target forwards (measured once it has drafted a few
   times: its seconds per draft position over one slot's share of a plain step,
   `DraftWorth.draft_cost`), r_i its rates over drafts of every tier, and y the share of
   its recent asks that gave a draft at all (a draft model stops under p_min, often at
   once). Where its drafts come in several tiers (a head's confidence classes), ask(k) is
   the mean over its tiers of the draft each would be cut to (`DraftWorth._by_tier`).
   It is not asked where no length is worth MIN_GAIN, nor where its recent asks saved
   less than nothing whatever its rates promise (ledger.py), but a few times while its
   rates are unknown (EXPLORE) and now and then after (REVISIT), so that they follow the
   text. What it drafts is then cut to the length worth the most to verify, drafting
   being paid by then, or dropped where no length is worth MIN_GAIN. A drafter that drafts
   for free (a lookup) is asked for n_max.

`Speculator.draft` (base.py) applies the second half to every drafter; a chain (chain.py)
compares its drafters' drafts by the same values.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from itertools import accumulate
from typing import TYPE_CHECKING

from specserve.speculative.cost import ForwardCost
from specserve.speculative.ledger import AskLedger
from specserve.speculative.rates import ANY, at

if TYPE_CHECKING:  # base.py builds a DraftWorth per speculator
    from specserve.speculative.base import Draft, DraftRequest, Speculator

# a draft is verified only if it promises this much more than no draft: the rates and
# costs are estimates, and a verify step costs a little outside the forward too (the
# k + 1 rows' sampling, the commit); at break-even a draft would only add noise
MIN_GAIN = 1.05
# a costly drafter with fewer verified drafts than this is asked (one token, at most this
# many times) even when the prior's 1-in-2 rates say it cannot pay: with them alone a 0.5B
# draft model for the 1.5B target (a third of a step per token) was never asked, so its
# real rates were never learnt
EXPLORE = 4
# a costly drafter judged not worth asking is still asked for one token every REVISIT-th
# time: unasked, it would never learn that the text changed (a server whose first requests
# were prose would never ask the head again for code); its draft teaches each of its tokens
# whether verified or not (rates.py), for 1/REVISIT of its drafting cost
REVISIT = 16
# a costly drafter is priced by its own measured asks once it has PRICED of them (the
# median of the last PRICE_KEEP), and by its prior until then. Priced by its weights' bytes,
# an EAGLE-3 head cost twice what it was charged: the LM head, the vocabulary mapping and
# the softmax for p_min are paid per ask as well (docs/perf/2026-11-27-eagle3-1.5b.md)
PRICED = 3
PRICE_KEEP = 16
# y, the share of asks that give a draft, is learnt per slot over its sequence's last
# YIELD_KEEP asks (it follows the text: prose leaves a draft model unsure more often than
# code), starting from YIELD_PRIOR asks that gave one. Learnt across requests, a served
# prose answer's y held the draft model unasked through the next request's C answer
# (docs/perf/2026-12-02-served-first.md). Learnt as drafts whose first token missed, an ask
# that gave nothing dragged the rates of what the drafter did draft down with it: the 0.5B's
# head, whose drafts kept 80 % on C, was judged by 38 % and no longer asked
# (docs/perf/2026-11-28-eagle3-unsure.md)
YIELD_KEEP = 32
YIELD_PRIOR = 2
# an ask that took more than STALLED times the drafter's steady price was held up (the VM
# stalled), not dear: one such ask, charged in full to the ledger, stopped the 0.5B draft
# model on the 1.5B's Java answer (docs/perf/2026-11-30-ask-ledger.md)
STALLED = 2.0
# a cheaper costly drafter is ranked behind a dearer one once this many of its asks in a
# chain are known (`DraftWorth.spares`), judged by the last SPARE_KEEP of them
SPARE_LEAST = 4
SPARE_KEEP = 16


class DraftBudget:
    """The engine's half: per slot and drafter a limit that follows acceptance, and the
    step's cost."""

    def __init__(self, cost: ForwardCost) -> None:
        self.cost = cost
        self._limit: dict[int, dict[str, int]] = {}  # slot -> drafter type -> limit

    def limit(self, asks: Sequence[DraftRequest], base_rows: int) -> list[DraftRequest]:
        """The asks with each slot's limits per drafter (`DraftRequest.limited`), all with
        cost[k] up to the longest n_max (base_rows: what the step's forward has without
        drafts)."""
        cost = self.cost.relative(base_rows, max((a.n_max for a in asks), default=0))
        unit = self.cost.share_seconds(base_rows)
        return [
            replace(a, cost=cost, step_seconds=unit, limits=dict(self._limit.get(a.slot, {})))
            for a in asks
        ]

    def update(self, slot: int, n_proposed: int, n_accepted: int, n_max: int, source: str) -> None:
        """The slot's draft of n_proposed tokens by drafter `source` kept n_accepted; n_max:
        the request's."""
        if n_proposed == 0:
            return
        own = self._limit.setdefault(slot, {})
        if n_accepted == n_proposed:
            own[source] = min(n_max, max(1, 2 * own.get(source, n_max)))
        else:
            own[source] = n_accepted + 1

    def reset(self, slot: int) -> None:
        self._limit.pop(slot, None)


class DraftWorth:
    """One drafter's half: what its drafts are worth, how long it is asked for one, and
    where what it drafted is cut. Reads the drafter's rates (its `acceptance_rates`, which
    a chain answers with the chosen child's) and its cost per draft token (`draft_cost`)."""

    def __init__(self, drafter: Speculator) -> None:
        self.drafter = drafter
        self._prices: deque[float] = deque(maxlen=PRICE_KEEP)  # its asks' measured costs
        self._yields: dict[int, deque[bool]] = {}  # slot -> whether each ask gave a draft
        self._asked: dict[int, tuple[int, int]] = {}  # slot -> (context length, n_max) asked
        self.explored = 0  # asks made against the estimate, to learn the rates (EXPLORE)
        self.declined = 0  # asks not made since the last revisit (REVISIT)
        self._revisits: set[int] = set()  # slots a chain asks this drafter on to revisit
        self.ledger = AskLedger()  # what its asks saved: the check on its rates (ledger.py)
        # in a chain, what each recent ask's draft was worth as made (0: nothing)
        self.made: deque[float] = deque(maxlen=SPARE_KEEP)

    def priced(self, seconds: float, asked: Sequence[DraftRequest], made: Sequence[Draft]) -> None:
        """The drafter answered `asked` with `made` in `seconds`. Kept as seconds per draft
        position run over one slot's share of a plain step (req.step_seconds; an unmeasured
        step prices nothing), the two taken together so that the VM's drifting speed, which
        moves both, does not move the price. Only asks in steady state are kept: an ask after
        a pause (a revisit, a new prompt) first catches up over every token since, and priced
        at that, a drafter once declined looked dearer at each revisit and was never asked
        again (the 0.5B draft on the 1.5B's prose: 0.9 of a step a token, against 0.4).
        The ledger takes each ask at what it cost, or after a pause at the steady price,
        for the same reason, and at most STALLED times that (asks whose rows are unpriced,
        cost None, it does not judge)."""
        steady = all(self._steady(r) for r in asked)
        for r in asked:
            self._asked[r.slot] = (len(r.tokens), r.n_max)
        unit = asked[0].step_seconds if asked else None
        run = [min(r.n_max, len(d) + 1) for r, d in zip(asked, made, strict=True)]
        total = sum(run)
        price = seconds / total / unit if unit and total > 0 and seconds > 0 else None
        if steady and price is not None:
            self._prices.append(price)
            price = min(price, STALLED * self.draft_cost)
        else:
            price = self.draft_cost
        for r, positions in zip(asked, run, strict=True):
            if r.cost is not None:  # where rows are free nothing is judged
                self.ledger.asked(r.slot, price * positions)

    def yielded(self, slot: int, made: bool) -> None:
        """An ask for `slot` gave a draft (made) or nothing (the drafter was unsure of its
        first token)."""
        self._yields.setdefault(slot, deque(maxlen=YIELD_KEEP)).append(made)

    def yield_rate(self, slot: int) -> float:
        """y on `slot`: the share of its sequence's recent asks that gave a draft
        (YIELD_KEEP, YIELD_PRIOR)."""
        seen = self._yields.get(slot, ())
        return (sum(seen) + YIELD_PRIOR) / (len(seen) + YIELD_PRIOR)

    def _steady(self, req: DraftRequest) -> bool:
        """Whether the slot was asked the step before: its context grew by at most that
        draft and the target's own token since."""
        if req.slot not in self._asked:
            return False
        length, n_max = self._asked[req.slot]
        return len(req.tokens) - length <= n_max + 1

    def forget(self, slot: int) -> None:
        """The slot starts another sequence: its next ask catches up over a new prompt."""
        self._asked.pop(slot, None)
        self._yields.pop(slot, None)
        self.ledger.forget(slot)

    @property
    def draft_cost(self) -> float:
        """c: the drafter's cost per draft token in plain steps. Measured (PRICED asks) for
        a costly drafter, so everything an ask pays counts: a head's LM head and p_min
        softmax, the catch-up over what the step before added, and the asks that fell
        under p_min at once. Before that, its prior `relative_cost` (its bytes
        or size ratio); 0 for a lookup, which drafts for free."""
        prior = self.drafter.relative_cost
        if prior == 0 or len(self._prices) < PRICED:
            return prior
        return statistics.median(self._prices)

    def values(self, req: DraftRequest, n: int, tier: int = 0) -> list[float]:
        """value(k) for k = 0..n (the module doc), for a draft of this tier on req's slot."""
        return self._per_step(req, n, tier)

    def ask_values(
        self, req: DraftRequest, n: int, draft_cost: float, by_tier: bool = True
    ) -> list[float]:
        """ask(k) for k = 0..n (the module doc): what asking for k tokens is worth, its
        drafting counted, whatever tier the draft turns out to be. A drafter whose drafts
        come in several tiers is judged by what each tier's draft would be cut to, as
        often as that tier comes (`_by_tier`; by_tier False: by its rates over all)."""
        shares = self.drafter.rates.tier_shares(req.slot) if by_tier else {}
        if len(shares) < 2:
            return self._per_step(req, n, ANY, self.yield_rate(req.slot), draft_cost)
        return self._by_tier(req, n, draft_cost, shares)

    def _by_tier(
        self, req: DraftRequest, n: int, draft_cost: float, shares: dict[int, float]
    ) -> list[float]:
        """ask(k) as the mean over tiers t (share p_t) of a k-token draft cut to the k_t
        worth verifying (k_t = 0: dropped, no row paid):

            ask(k) = (1 + y sum_t p_t sum_{i<k_t} r_t,i)
                     / ((1 - y) cost(0) + y sum_t p_t cost(k_t) + c k)

        Judged by the rates of every tier at once, the 0.5B's head, whose unsure drafts are
        dropped, was priced by them too and went unasked on C where its sure ones paid."""
        y = self.yield_rate(req.slot)
        gain = [1.0] * (n + 1)
        paid = [(1 - y) * req.verify_cost(0) + draft_cost * k for k in range(n + 1)]
        for tier, share in shares.items():
            kept = list(accumulate(self.drafter.acceptance_rates(req.slot, n, tier), initial=0.0))
            values = [(1 + g) / req.verify_cost(k) for k, g in enumerate(kept)]  # value(k)
            cuts = _cut_lengths(values)
            for k in range(n + 1):
                gain[k] += y * share * kept[cuts[k]]
                paid[k] += y * share * req.verify_cost(cuts[k])
        return [g / c for g, c in zip(gain, paid, strict=True)]

    def _per_step(
        self, req: DraftRequest, n: int, tier: int, y: float = 1.0, draft_cost: float = 0.0
    ) -> list[float]:
        """ask(k) for k = 0..n; a made draft's value(k) is its case y = 1, c = 0."""
        rates = self.drafter.acceptance_rates(req.slot, n, tier)
        gains = accumulate((y * r for r in rates), initial=1.0)
        unsure = (1 - y) * req.verify_cost(0)
        return [g / (unsure + y * req.verify_cost(k) + draft_cost * k) for k, g in enumerate(gains)]

    def value(self, req: DraftRequest, d: Draft) -> float:
        """What verifying the whole of draft `d` is worth."""
        return self.values(req, len(d), tier=d.tier)[len(d)]

    def best_value(self, req: DraftRequest, by_tier: bool = True) -> float:
        """The most a draft of up to n_max tokens, counting its drafting cost, is worth
        (by_tier: `ask_values`)."""
        return max(self.ask_values(req, req.n_max, self.draft_cost, by_tier))

    def ask_length(self, req: DraftRequest) -> int | None:
        """How many tokens the drafter is asked for; None: it is not asked. A drafter that
        drafts for free is asked for n_max; one that pays per token for the length worth the
        most with its drafting counted, or, while its rates are unknown, for one token. A
        revisit asks for that length too where only the ledger held the drafter back (a
        draft model's worth is in long drafts, which one token cannot show), else for one."""
        draft_cost = self.draft_cost
        if draft_cost == 0 or req.cost is None:
            return req.n_max
        values = self.ask_values(req, req.n_max, draft_cost)
        best = _best_length(values)
        worth = best if best and values[best] >= MIN_GAIN else 0
        if req.slot in self._revisits:  # a chain's (may_ask)
            self._revisits.discard(req.slot)
            return worth or 1
        if worth and self.ledger.paying(req.slot):
            return worth
        if best and self._untried():
            self.explored += 1
            return 1
        return (worth or 1) if best and self._revisit_due() else None

    @property
    def unknown(self) -> bool:
        """Whether its rates are still a prior that nothing measured: untried, and no
        calibration for its drafts' confidence (a trained head's comes with it, rates.py)."""
        return not self.drafter.rates.first_rates and self._untried()

    def asked_for(self, req: DraftRequest) -> bool:
        """Whether a costly drafter drafted for req's slot at req's context (`priced`)."""
        return self._asked.get(req.slot, (-1, 0))[0] == len(req.tokens)

    def _untried(self) -> bool:
        """Whether the drafter's rates are still its prior's (EXPLORE); counted in asks, as
        asks can come to nothing."""
        untried = at(self.drafter.rates.overall.reached, 0) < EXPLORE
        return untried and self.explored < EXPLORE

    def may_ask(self, req: DraftRequest, beat: float) -> bool:
        """Whether a chain holding a draft worth `beat` for req's slot asks this drafter: if
        it could do better, while its rates are unknown (EXPLORE: judged by the prior alone,
        the 0.5B draft went unasked for the 1.5B's first steps after the head's first draft
        missed), and now and then where it could not (REVISIT)."""
        if self.ledger.paying(req.slot) and self.best_value(req) > beat:
            return True
        if req.n_max > 0 and self._untried():
            return True
        if req.n_max > 0 and self._revisit_due():
            self._revisits.add(req.slot)
            return True
        return False

    def spares(self, req: DraftRequest, promise: float) -> bool:
        """Whether asked before a dearer drafter that promises `promise` for req's slot,
        this one's draft would usually be worth more and so spare that ask: most of its
        recent drafts were (SPARE_LEAST of them at least). Before that, most of a
        calibrated head's drafts would be by its classes' shares, each as a first token
        alone; a drafter with neither keeps its place."""
        if len(self.made) >= SPARE_LEAST:
            return 2 * sum(v > promise for v in self.made) >= len(self.made)
        shares = self.drafter.rates.first_shares
        if not shares:
            return True
        beating = sum(p for tier, p in shares.items() if self._first_alone(req, tier) > promise)
        return 2 * beating >= 1

    def _first_alone(self, req: DraftRequest, tier: int) -> float:
        """What a one-token draft of this tier is worth, 0 where that is under MIN_GAIN."""
        value = self.values(req, 1, tier)[1]
        return value if value >= MIN_GAIN else 0.0

    def _revisit_due(self) -> bool:
        """One more ask declined; True (and the count starts over) at every REVISIT-th."""
        self.declined += 1
        if self.declined < REVISIT:
            return False
        self.declined = 0
        return True

    def cut_length(self, req: DraftRequest, d: Draft) -> int:
        """The length of `d` worth verifying, 0 if none is worth MIN_GAIN (whole when rows
        are free: req.cost None). On a CPU the first extra row can cost nearly a whole
        step, so a short, doubtful draft is often worth less than none."""
        if not d or req.cost is None:
            return len(d)
        return _cut_lengths(self.values(req, len(d), tier=d.tier))[len(d)]


def _cut_lengths(values: Sequence[float]) -> list[int]:
    """For k = 0..len(values) - 1, the length a k-token draft with these value(j) is cut
    to: the j in 1..k of the highest value (the shortest of equals), 0 if that is under
    MIN_GAIN. Running over k, so a head's ask value gets every k's cut in one pass."""
    cuts, best = [0], 0
    for k in range(1, len(values)):
        if values[k] >= MIN_GAIN and (not best or values[k] > values[best]):
            best = k
        cuts.append(best)
    return cuts


def _best_length(values: Sequence[float]) -> int:
    """The k >= 1 of the highest value (the shortest of equals); 0 if values has no k >= 1."""
    return max(range(1, len(values)), key=lambda k: (values[k], -k), default=0)
