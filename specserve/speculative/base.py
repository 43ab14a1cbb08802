"""The one interface every speculator implements, and the statistics they all report.

Shape of the protocol (after llama.cpp's common/speculative.h):

    spec.begin(slot, prompt, tenant)    # a slot starts a new sequence (of tenant's: tenants.py)
    drafts = spec.draft(requests)       # one DraftRequest per decoding slot -> one Draft each
    spec.accept(slot, n_accepted)       # how many of that slot's last draft the target kept
    spec.reset(slot)                    # the slot is freed

Speculators only propose tokens. They never touch the target's memory, and the engine
never asks which kind of speculator it holds. Subclasses implement `_draft` (and
optionally `_begin`, `_accept`, `_reset`); counting and timing happen here, once, and so
does the length of every draft: `draft` asks each drafter for, and cuts what it drafted
to, what its `DraftWorth` (speculative/draft_length.py) says is worth verifying.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import ClassVar, TypeVar

import torch

from specserve.speculative.draft_length import DraftWorth
from specserve.speculative.rates import AcceptanceModel, count_kept, count_positions, grow

S = TypeVar("S")


def slot_state(table: dict[int, S], slot: int, make: Callable[[], S]) -> S:
    """table[slot], made by make() the first time. Not dict.setdefault(slot, make()): that
    builds a new state (numpy buffers, dicts) for every slot of every step, used or not."""
    state = table.get(slot)
    if state is None:
        state = table[slot] = make()
    return state


@dataclass
class DraftRequest:
    """What a speculator is asked for one slot.

    tokens: the slot's whole context so far (prompt + every emitted token, the last one
        being the token the target produced most recently and has not yet fed back).
    n_max: most draft tokens wanted; n_min: drafts shorter than this are dropped (empty).
    """

    slot: int
    tokens: Sequence[int]
    n_max: int
    _: KW_ONLY  # the rest by name: eight positional fields read as a riddle
    n_min: int = 0
    p_min: float = 0.0
    # speculator types this request allows (None = any); others answer with an empty draft
    types: tuple[str, ...] | None = None
    # cost[k]: verifying k draft tokens, in plain steps (speculative/cost.py, from the engine);
    # None: rows are free, drafts are never cut for cost (a drafter's own semantics)
    cost: Sequence[float] | None = None
    # the unit of cost[k] in seconds, as measured (one slot's share of a plain step): what a
    # costly drafter's own time is priced against (draft_length.py); None: not measured
    step_seconds: float | None = None
    # the tokens the client expects back (OpenAI's `prediction`; speculative/prediction.py)
    prediction: Sequence[int] = ()
    # a sampled request's temperature and seed (0.0: greedy): a drafter with probabilities
    # may then sample its draft and return them, for rejection sampling (verify.py)
    temperature: float = 0.0
    seed: int = 0
    # per drafter type, the slot's draft limit from that drafter's own drafts (DraftBudget,
    # draft_length.py): one drafter's miss does not cut another's next ask
    limits: Mapping[str, int] = field(default_factory=dict)
    # how many runners-up per draft token the slot can verify (verify.py `verify_greedy`;
    # 0 where it cannot: sampled, penalised, constrained, recurrent)
    alternatives: int = 0

    def limited(self, name: str) -> DraftRequest:
        """The request as drafter `name` gets it: n_max cut to its own limit."""
        limit = self.limits.get(name)
        return self if limit is None or limit >= self.n_max else replace(self, n_max=limit)

    def verify_cost(self, k: int) -> float:
        """cost[k]; the engine sends one entry per length up to the largest n_max asked."""
        return 1.0 if self.cost is None else self.cost[k]

    def row_cost(self, k: int) -> float:
        """What one more row costs after k draft tokens' rows, in plain steps (past the
        last length sent, the last row's)."""
        cost = self.cost
        if cost is None or len(cost) < 2:
            return 0.0
        k = min(k, len(cost) - 2)
        return cost[k + 1] - cost[k]


@dataclass
class Draft:
    """Proposed tokens for one slot; `probs` is the drafter's distribution when it has one.

    tokens: [k] proposed token ids (k may be 0).
    probs: [k, V] draft probabilities q(x | prefix) for each proposed position, or None.
    tier: the drafter's confidence class for this draft (suffix: how long a suffix of the
        context it matched); acceptance is learnt per tier (speculative/rates.py).
    source: the type of the speculator that proposed it (a chain passes its child's on), so
        the server can tell clients whose tokens were kept.
    alternatives: other tokens for some of its positions, verified beside the draft where
        greedy decoding of a KV-only target can (speculative/verify.py `verify_greedy`):
        alternatives[j] stands in for tokens[alt_at[j]], with the drafter's probability
        alt_probs[j] there.
    """

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    tier: int = 0
    source: str = ""
    alternatives: list[int] = field(default_factory=list)
    alt_probs: list[float] = field(default_factory=list)
    alt_at: list[int] = field(default_factory=list)

    def add(self, token: int, others: Sequence[tuple[int, float]] = ()) -> None:
        """Append a token, and `others` (token, probability) as its alternatives."""
        for t, p in others:
            self.alternatives.append(t)
            self.alt_probs.append(p)
            self.alt_at.append(len(self.tokens))
        self.tokens.append(token)

    def branched(self, keep: Sequence[int]) -> Draft:
        """The draft with only its alternatives of indices `keep`."""
        return replace(
            self,
            alternatives=[self.alternatives[j] for j in keep],
            alt_probs=[self.alt_probs[j] for j in keep],
            alt_at=[self.alt_at[j] for j in keep],
        )

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class SpecStats:
    """Counters every speculator reports (llama.cpp's names in brackets).

    drafts_generated: non-empty drafts proposed [n_gen_drafts]
    drafts_accepted: drafts of which at least one token was kept [n_acc_drafts]
    tokens_generated: draft tokens proposed [n_gen_tokens]
    tokens_accepted: draft tokens kept [n_acc_tokens]
    accepted_per_pos[i]: how often draft position i was kept
    proposed_per_pos[i]: how often a draft had a token at position i
    reached_per_pos[i]: how often the target reached draft position i (it was proposed and
        every position before it kept), so accepted / reached is position i's own rate
    accept_len_hist[n]: how many drafts had exactly n tokens kept
    drafts_full: drafts kept whole; empty_drafts: draft() answers with no tokens for a slot
    draft_seconds: wall time spent inside draft()

    Drafts are counted when they are verified (accept), so a draft that a chain did not
    use (discard) does not count against its drafter.
    """

    drafts_generated: int = 0
    drafts_accepted: int = 0
    tokens_generated: int = 0
    tokens_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    proposed_per_pos: list[int] = field(default_factory=list)
    reached_per_pos: list[int] = field(default_factory=list)
    accept_len_hist: list[int] = field(default_factory=list)
    drafts_full: int = 0
    empty_drafts: int = 0
    draft_seconds: float = 0.0

    def record_draft(self, n_tokens: int) -> None:
        self.drafts_generated += 1
        self.tokens_generated += n_tokens
        count_positions(self.proposed_per_pos, n_tokens)

    def record_accept(self, n_accepted: int, n_proposed: int) -> None:
        self.drafts_full += int(n_accepted == n_proposed)
        self.tokens_accepted += n_accepted
        self.drafts_accepted += int(n_accepted > 0)
        count_kept(self.accepted_per_pos, self.reached_per_pos, n_accepted, n_proposed)
        grow(self.accept_len_hist, n_accepted + 1)
        self.accept_len_hist[n_accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.tokens_accepted / self.tokens_generated if self.tokens_generated else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "drafts_generated": self.drafts_generated,
            "drafts_accepted": self.drafts_accepted,
            "tokens_generated": self.tokens_generated,
            "tokens_accepted": self.tokens_accepted,
            "acceptance_rate": self.acceptance_rate,
            "accepted_per_pos": list(self.accepted_per_pos),
            "proposed_per_pos": list(self.proposed_per_pos),
            "reached_per_pos": list(self.reached_per_pos),
            "accept_len_hist": list(self.accept_len_hist),
            "drafts_full": self.drafts_full,
            "empty_drafts": self.empty_drafts,
            "draft_seconds": self.draft_seconds,
        }


class Speculator:
    """Base class: subclasses override `_draft` and, where they keep per-slot state, the hooks."""

    name = "base"

    def __init__(self) -> None:
        self.stats = SpecStats()
        # kept-rates, from which drafts are valued
        self.rates = AcceptanceModel(self.first_rates, self.prior)
        self.worth = DraftWorth(self)  # how long its drafts are (speculative/draft_length.py)
        # the draft proposed last for each slot (its length as offered, the draft whole), so
        # accept() can be checked and counted and a chain's relabelling recut from the whole
        self._last: dict[int, tuple[int, Draft]] = {}
        self._tenants: dict[int, str | None] = {}  # slot -> whose sequence it holds

    # tier -> the prior of its first position where the tier is a probability (rates.py)
    first_rates: ClassVar[Mapping[int, float]] = {}
    # the chance each draft position is kept, before any is verified (rates.py)
    prior: ClassVar[float] = 0.5

    # drafting cost per token, in target forwards (a draft model's forward vs the target's)
    relative_cost: float = 0.0

    def begin(self, slot: int, prompt: Sequence[int], tenant: str | None = None) -> None:
        self._last.pop(slot, None)
        self.rates.forget(slot)
        self.worth.forget(slot)
        if slot in self._tenants:  # reused without reset(): its last sequence ends as its own
            self._reset(slot)
        self._tenants[slot] = tenant
        self._begin(slot, prompt)

    def tenant(self, slot: int) -> str | None:
        """Whose sequence the slot holds (the request's cache_salt; None: the default)."""
        return self._tenants.get(slot)

    def serves(self, types: tuple[str, ...] | None) -> bool:
        """Whether a request that allows `types` may get this speculator's drafts."""
        return types is None or self.name in types

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One draft per request: the drafter is asked for the length worth drafting and
        what it drafts is cut to the length worth verifying (`self.worth`), then counted."""
        t0 = time.perf_counter()
        requests = [r.limited(self.name) for r in requests]
        for req in requests:  # the token after each slot's last draft is known now
            self.rates.settle(req.slot, req.tokens)
        asked = [r for r in map(self._ask, requests) if r is not None]
        t_ask = time.perf_counter()
        drafts = [self._named(d) for d in (self._draft(asked) if asked else [])]
        made = dict(zip((r.slot for r in asked), drafts, strict=True))
        t_end = time.perf_counter()
        self.stats.draft_seconds += t_end - t0
        if asked and self.relative_cost > 0:
            self.worth.priced(t_end - t_ask, asked, drafts)
        out = []
        for req in requests:
            full = _clip(made.get(req.slot, Draft()), req.n_max)
            if req.slot in made and self.relative_cost > 0:
                # nothing: unsure, not wrong (draft_length.py)
                self.worth.yielded(req.slot, bool(full))
            d = self._offer(req, full)
            self.stats.empty_drafts += int(not d)
            out.append(d)
        return out

    def _offer(self, req: DraftRequest, full: Draft) -> Draft:
        """`full` cut to the length worth verifying (empty under n_min), remembered as the
        slot's last draft, and held whole until the target's output shows how much of it
        holds, verified or not (rates.py)."""
        d = _clip(full, self.worth.cut_length(req, full))
        if len(d) < max(req.n_min, 1):
            d = Draft()
        elif d.alternatives:
            d = self._branched(req, d)
        self.rates.hold(req.slot, len(req.tokens), full.tokens, full.tier)
        self._last[req.slot] = (len(d), full)
        self.worth.ledger.offered(req.slot, req.verify_cost(len(d)))
        return d

    def _branched(self, req: DraftRequest, d: Draft) -> Draft:
        """`d` with the alternatives worth their verify row. Alternative a at draft position
        i adds a token where the draft's tokens before i are kept (r_{i-1}, rates.py) and
        the target's token at i is a (p(a), by the drafter), for one more row: the likeliest
        to add one are kept while that chance over the row's cost exceeds the draft's value
        (tokens per step-equivalent, draft_length.py)."""
        at = [j for j, i in enumerate(d.alt_at) if i < len(d)][: req.alternatives * len(d)]
        if not at:
            return d.branched([])
        reach = [1.0, *self.acceptance_rates(req.slot, len(d), d.tier)]
        chance = {j: reach[d.alt_at[j]] * d.alt_probs[j] for j in at}
        value = self.worth.value(req, d)
        kept: list[int] = []
        for j in sorted(at, key=lambda j: -chance[j]):
            if chance[j] <= value * req.row_cost(len(d) + len(kept)):
                break
            kept.append(j)
        return d.branched(sorted(kept))

    def _named(self, d: Draft) -> Draft:
        """The draft with its proposer's type: a chain's drafts keep their child's."""
        return d if d.source else replace(d, source=self.name)

    def _ask(self, req: DraftRequest) -> DraftRequest | None:
        """The request as this drafter gets it, or None if it is not asked: its types must
        allow it, and its n_max is what DraftWorth.ask_length says is worth drafting."""
        if not self.serves(req.types):
            return None
        n = self.worth.ask_length(req)
        return None if n is None else replace(req, n_max=n)

    def acceptance_rates(self, slot: int, n: int, tier: int = 0) -> list[float]:
        """r_0..r_{n-1}: the chance that positions 0..i of a draft of this tier on `slot`
        are all kept (speculative/rates.py)."""
        return self.rates.rates(slot, tier, n)

    def accept(self, slot: int, n_accepted: int) -> None:
        """The target kept n_accepted tokens of the slot's last draft."""
        proposed, whole = self._last.pop(slot, (0, Draft()))
        if not 0 <= n_accepted <= proposed:
            raise ValueError(f"slot {slot}: accepted {n_accepted} of a {proposed}-token draft")
        self.worth.ledger.settle(slot, n_accepted if proposed else None)
        if proposed:  # as llama.cpp: the statistics count verified, non-empty drafts
            self.stats.record_draft(proposed)
            self.stats.record_accept(n_accepted, proposed)
            self.rates.verified(slot, whole.tier, n_accepted, proposed)
            self._accept(slot, n_accepted, proposed)

    def retier(self, req: DraftRequest, tier: int) -> Draft:
        """The slot's last draft as of `tier`, which a chain learnt of it after it was made
        (chain.py): held and learnt whole under that tier, and cut to the length its rates
        make worth verifying, empty if none."""
        _, whole = self._last.get(req.slot, (0, Draft()))
        return self._offer(req, replace(whole, tier=tier))

    def discard(self, slot: int) -> None:
        """The slot's last draft was not verified (a chain chose another drafter's); the
        rates still learn from it, whole (rates.py), and its ask brought nothing."""
        self._last.pop(slot, None)
        self.worth.ledger.settle(slot, None)

    def reset(self, slot: int) -> None:
        self._last.pop(slot, None)
        self.rates.forget(slot)
        self.worth.forget(slot)
        self._reset(slot)
        self._tenants.pop(slot, None)

    def save_state(self, slot: int) -> tuple[object, int]:
        """(state, bytes): the slot's per-sequence state that is not a function of its tokens
        (a draft model's memory), saved with the target's in the prompt store; (None, 0)
        where a speculator rebuilds all it keeps from the prompt at `begin`."""
        return None, 0

    def restore_state(self, slot: int, state: object) -> None:
        """Put back what `save_state` gave, into any slot, before that slot's `begin`."""

    def learn(self, output: Sequence[int], tenant: str | None = None) -> bool:
        """Take in an output generated elsewhere (another replica) as if it had finished
        here; False where this speculator keeps nothing across requests."""
        return False

    # hooks -------------------------------------------------------------------------------
    def _begin(self, slot: int, prompt: Sequence[int]) -> None:
        pass

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        raise NotImplementedError

    def _accept(self, slot: int, n_accepted: int, n_proposed: int) -> None:
        """n_accepted of the n_proposed (> 0) tokens drafted last for `slot` were kept."""

    def _reset(self, slot: int) -> None:
        pass


def _clip(d: Draft, n_max: int) -> Draft:
    if len(d) <= n_max:
        return d
    probs = d.probs[:n_max] if d.probs is not None else None
    clipped = replace(d, tokens=list(d.tokens[:n_max]), probs=probs)
    return clipped.branched([j for j, i in enumerate(d.alt_at) if i < n_max])
