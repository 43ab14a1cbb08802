"""`chain`: several speculators; per slot and step, the draft worth the most is verified.

llama.cpp's chain takes the first non-empty draft in a fixed order. Here every draft is
scored by the tokens it is expected to yield per unit of cost (draft_length.py):

    value(k) = (1 + sum_{i < k} r_i) / (cost(k) + c * k)

r_i is the drafter's acceptance at position i for this slot, cost(k) what verifying k rows
costs on this machine (speculative/cost.py), c the drafter's own cost per token in target
forwards, and the 1s are the target's own token and step. No draft is worth 1. Cheap
drafters are asked first; a costly one (a draft model, a head) is asked only for slots where
it could beat the best draft so far, or now and then to keep its rates current (REVISIT);
where a costly drafter's draft stands, or it was asked and drafted nothing (it was unsure
there), those that cost less are not asked (`_outranked`); costly drafters whose rates are
still an unmeasured prior are asked first, and a cheaper one whose recent drafts were
mostly worth less than a dearer one promises after it (`_order`).
Between drafts already made, drafting is paid for, so only verification counts. So the
costly ones are asked in the order of what they promise this step, drafting counted: asked
first, a head whose one-token drafts the draft model's then beat every time on code was
paid for in every step, and the 1.5B's chain ran at 0.80-1.04 of its speed without the head
(docs/perf/2026-11-27-eagle3-price.md). The order takes each drafter's rates over all its
tiers, a head's unsure drafts counted as verified: by what its drafts would be cut to, the
head came first and the 0.5B draft's longer drafts went unasked, and the 1.5B's chain was
slower on code (docs/perf/2026-11-28-eagle3-calibrated.md).

Where a costly drafter drafts for a slot whose best draft so far is a free one, the free
draft is relabelled by whether the two agree on their first token (`AGREED`, `CONTESTED`),
its rates learnt per label like any tier, and valued again: a head that reads the target's
states is evidence about a lookup's guess, and the record of the lookup's other drafts is
not.

A costly drafter's ask is settled against the draft it would displace, as judged once its
own draft witnessed it (`_promise`): what it saved is only what it added to that
(ledger.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from specserve.speculative.base import Draft, DraftRequest, Speculator

# where a costly drafter (a head that reads the target's states, a draft model) drafted too,
# a free drafter's draft is learnt in its tier plus one of these, as the two drafts' first
# tokens agree or not: a lookup's short match is kept far less often where the head says
# otherwise, and learnt as one, the record of its other drafts made it win there
# (docs/perf/2026-11-28-head-calibration.md)
AGREED = 1 << 20
CONTESTED = 2 << 20


class ChainSpeculator(Speculator):
    """Drafts nothing itself, so costs nothing itself (relative_cost 0): its children's
    asks are priced and settled in their ledgers, never the chain's."""

    name = "chain"

    def __init__(self, children: Sequence[Speculator]) -> None:
        super().__init__()
        if not children:
            raise ValueError("a chain needs at least one speculator")
        # cheap drafters first, so costly ones are asked only where they can still win
        self.children = sorted(children, key=lambda s: s.relative_cost)
        self._chosen: dict[int, Speculator] = {}

    def _ask(self, req: DraftRequest) -> DraftRequest | None:
        return req if self.serves(req.types) else None  # each child decides for itself

    def acceptance_rates(self, slot: int, n: int, tier: int = 0) -> list[float]:
        """The rates of the child whose draft the slot got (its draft is that child's)."""
        chosen = self._chosen.get(slot)
        if chosen is None:
            return super().acceptance_rates(slot, n, tier)
        return chosen.acceptance_rates(slot, n, tier)

    def serves(self, types: tuple[str, ...] | None) -> bool:
        return any(s.serves(types) for s in self.children)

    def _begin(self, slot: int, prompt: Sequence[int]) -> None:
        for s in self.children:
            s.begin(slot, prompt, self.tenant(slot))

    def save_state(self, slot: int) -> tuple[object, int]:
        states = [s.save_state(slot) for s in self.children]
        if all(state is None for state, _ in states):
            return None, 0
        return [state for state, _ in states], sum(n for _, n in states)

    def restore_state(self, slot: int, state: object) -> None:
        if not isinstance(state, list) or len(state) != len(self.children):
            raise TypeError("a chain restores the list of its children's states")
        for child, own in zip(self.children, state, strict=True):
            if own is not None:
                child.restore_state(slot, own)

    def learn(self, output: Sequence[int], tenant: str | None = None) -> bool:
        learned = [s.learn(output, tenant) for s in self.children]
        return any(learned)

    def _reset(self, slot: int) -> None:
        self._chosen.pop(slot, None)
        for s in self.children:
            s.reset(slot)

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        best = {r.slot: (1.0, Draft()) for r in requests}
        doubted: dict[int, float] = {}  # slot -> the dearest costly drafter that drafted nothing
        for r in requests:
            self._chosen.pop(r.slot, None)
        for child in self._order(requests):
            costly = child.relative_cost > 0
            # a revisit is due only where the child may draft at all; each child is asked
            # up to its own limit (DraftBudget)
            asks = [
                r
                for r in (q.limited(child.name) for q in requests)
                if child.serves(r.types)
                and not self._outranked(child, r.slot, doubted)
                and (not costly or child.worth.may_ask(r, best[r.slot][0]))
            ]
            if not asks:
                continue
            for req, d in zip(asks, child.draft(asks), strict=True):
                if costly and not d and child.worth.asked_for(req):
                    doubted[req.slot] = max(doubted.get(req.slot, 0.0), child.relative_cost)
                if costly and d:
                    self._witness(req, d, best)
                    child.worth.ledger.against(req.slot, self._promise(req, *best[req.slot]))
                value = child.worth.value(req, d) if d else 0.0
                if costly and child.worth.asked_for(req):
                    child.worth.made.append(value)
                if value > best[req.slot][0]:
                    if req.slot in self._chosen:
                        self._chosen[req.slot].discard(req.slot)
                    best[req.slot] = (value, d)
                    self._chosen[req.slot] = child
                else:
                    child.discard(req.slot)
        return [best[r.slot][1] for r in requests]

    @staticmethod
    def _promise(req: DraftRequest, value: float, d: Draft) -> float:
        """The plain steps draft `d`, worth `value`, promises to save: its expected tokens
        (value * cost) less its verification's cost."""
        return (value - 1) * req.verify_cost(len(d))

    def _outranked(self, child: Speculator, slot: int, doubted: dict[int, float]) -> bool:
        """Whether a costly drafter as dear as `child` or dearer has the slot's best draft
        so far, or was asked for it this step and drafted nothing worth verifying
        (`doubted`): a drafter that pays less per token reads less of a model, and `child`
        is not asked there at all, not even to learn its rates (they are learnt where it
        drafts alone). Asked after the 0.5B draft model had drafted, the 1.5B's head only
        ever repeated its first token or was wrong (docs/perf/2026-11-28-costly-pairs.md);
        asked where the draft model was unsure, its drafts missed, and those asks were most
        of what the head cost the 1.5B's code (docs/perf/2026-12-01-xeon-doubted.md)."""
        standing = self._chosen.get(slot)
        dearest = max(standing.relative_cost if standing else 0.0, doubted.get(slot, 0.0))
        return dearest >= child.relative_cost > 0

    def _witness(self, req: DraftRequest, d: Draft, best: dict[int, tuple[float, Draft]]) -> None:
        """A costly drafter drafted `d` where a free one's draft stands: the free draft is
        learnt and valued apart by whether its first token is `d`'s (`AGREED`, `CONTESTED`),
        and dropped if that leaves it worth nothing."""
        standing = self._chosen.get(req.slot)
        drafted = best[req.slot][1]
        if standing is None or standing.relative_cost > 0 or drafted.tier >= AGREED:
            return
        witnessed = AGREED if drafted.tokens[0] == d.tokens[0] else CONTESTED
        drafted = standing.retier(req, drafted.tier + witnessed)
        value = standing.worth.value(req, drafted) if drafted else 0.0
        if value > 1.0:
            best[req.slot] = (value, drafted)
            return
        standing.discard(req.slot)
        del self._chosen[req.slot]
        best[req.slot] = (1.0, Draft())

    def _order(self, requests: Sequence[DraftRequest]) -> list[Speculator]:
        """The children in the order they are asked this step: the free ones as listed,
        then the costly ones by the most their drafts promise over the step's slots, those
        whose rates are still an unmeasured prior's first (`DraftWorth.unknown`): one that
        will be asked anyway to learn its rates is asked before a cheaper one it may
        outrank. Ranked by its prior, the 0.5B draft model came after the 1.5B's head in
        an answer's first steps, and its drafts then beat the head's, paid for in vain
        (docs/perf/2026-12-01-xeon-doubted.md). A cheaper one whose recent drafts mostly
        were worth less than a dearer one promises goes behind it (`_behind`)."""
        free = [c for c in self.children if c.relative_cost == 0]
        costly = [c for c in self.children if c.relative_cost > 0]
        if len(costly) > 1:  # by the rates over all tiers: the module doc
            costly.sort(
                key=lambda c: (
                    not c.worth.unknown,
                    -sum(c.worth.best_value(r.limited(c.name), False) for r in requests),
                )
            )
            moved = True
            while moved:  # each swap puts a dearer drafter ahead, so this ends
                moved = False
                for i in range(len(costly) - 1):
                    if self._behind(costly[i], costly[i + 1], requests):
                        costly[i : i + 2] = costly[i + 1], costly[i]
                        moved = True
        return free + costly

    @staticmethod
    def _behind(cheap: Speculator, dear: Speculator, requests: Sequence[DraftRequest]) -> bool:
        """Whether `cheap`, ranked ahead of the dearer `dear`, goes behind it: `dear` is
        asked where it promises more than the draft in hand, and where `cheap`'s draft
        seldom beats that promise, asking `cheap` first only pays for a draft that `dear`'s
        then displaces. Ranked ahead by its promise, the 1.5B's head was asked first on the
        C answer, its one-token drafts worth less than the draft model promised, and the
        draft model was asked after it nearly every time (docs/perf/2026-12-01-spare-order.md)."""
        if not 0 < cheap.relative_cost < dear.relative_cost or dear.worth.unknown:
            return False
        # where its ledger stopped it, `dear` is asked now and then only, not by its promise
        promised = [r for r in requests if dear.worth.ledger.paying(r.slot)]
        spared = sum(
            cheap.worth.spares(r.limited(cheap.name), dear.worth.best_value(r.limited(dear.name)))
            for r in promised
        )
        return 2 * spared < len(promised)

    def _accept(self, slot: int, n_accepted: int, n_proposed: int) -> None:
        chosen = self._chosen.pop(slot, None)
        if chosen is not None:
            chosen.accept(slot, n_accepted)
