"""`mtp`: the target's own multi-token-prediction layer drafts (Qwen3-Next / Qwen3.5).

The MTP head turns (embedding of token x_{i+1}, target hidden state h_i) into a hidden
state that predicts x_{i+2} through the target's lm_head (models/qwen3_next.py MtpHead).
Its attention layer keeps its own KV cache here, one row per position i, so that:

- rows built from the *target's* hidden states are exact and stay: every step first feeds
  the rows the target's last forward made possible (its final hidden states come from the
  runner, `take_hidden`), the last of them proposing the first draft token;
- each further draft token d_j is fed with the head's *own* previous hidden state (the
  target has not run yet); those rows are approximations, dropped next step when the
  target's real hidden states for those positions arrive.

Drafts are argmax tokens without probabilities, like the draft model's, so verification
keeps speculation on == off token for token (speculative/verify.py). The first is proposed
however unsure the head is, the draft's tier saying how sure (`CONFIDENCE`), so that which
are worth verifying is learnt (rates.py); later ones stop under the request's p_min.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from specserve.batch import FlatBatch
from specserve.cache.kv import KVCache
from specserve.models.layers.embedding import Embedding
from specserve.models.qwen3_next import MtpHead
from specserve.speculative.base import Draft, DraftRequest, Speculator
from specserve.speculative.picks import top_tokens
from specserve.speculative.verify import Stream, position_uniforms, sample_from_probs

# a head's first draft token is proposed however unsure the head is, and labelled with its
# probability's class among these: which classes are worth verifying is learnt (rates.py)
# rather than set by one p_min. At llama.cpp's 0.75 most asks of the 0.5B's head gave
# nothing, on code whose unsure tokens it still got right more often than not
# (docs/perf/2026-11-28-eagle3-unsure.md)
CONFIDENCE = (0.2, 0.4, 0.6, 0.8)


def class_rates(bounds: Sequence[float]) -> dict[int, float]:
    """Each confidence tier's probability midway between its bounds: the prior of its
    first position's kept-rate (rates.py), as if the head were calibrated."""
    edges = [0.0, *bounds, 1.0]
    return {1 + i: (lo + hi) / 2 for i, (lo, hi) in enumerate(itertools.pairwise(edges))}


class HiddenSource(Protocol):
    """The target's runner, as far as the mtp speculator reads it."""

    record_hidden: bool

    def take_hidden(self, slot: int) -> tuple[int, torch.Tensor]: ...


class MtpModel(Protocol):
    """The target model: its MTP head, token embedding and logits (lm_head)."""

    mtp: MtpHead | None
    embed: Embedding

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class SlotMemory(Protocol):
    @property
    def num_slots(self) -> int: ...

    @property
    def max_len(self) -> int: ...


class MtpTarget(HiddenSource, Protocol):
    """The target's runner: its hidden states, its model (any: `mtp` is checked when the
    speculator is built) and its memory's size."""

    @property
    def model(self) -> Any: ...

    @property
    def memory(self) -> SlotMemory: ...


class HiddenStateDrafter(Speculator):
    """A head fed the target's hidden states (`take_hidden`), with its own KV cache whose
    rows past the last exact one are dropped each step (the module doc). Subclasses give
    `_forward`: one head step over every slot's rows."""

    first_rates = class_rates(CONFIDENCE)
    device: torch.device  # where the head runs (each subclass sets it)

    def __init__(
        self,
        target: HiddenSource,
        cache: KVCache,
        relative_cost: float,
        sample_drafts: bool = False,
    ) -> None:
        """sample_drafts: a sampled request's drafts are drawn from the head's distribution
        and sent with it (rejection sampling keeps more of them at temperature > 0, and the
        output keeps its distribution, but a seed no longer gives the text it gives without
        speculation); off: argmax drafts, seeded output the same on or off."""
        super().__init__()
        self.target = target
        self.cache = cache
        self.relative_cost = relative_cost
        self.sample_drafts = sample_drafts
        self._exact: dict[int, int] = {}  # slot -> head rows built from target hidden states
        # slot -> the position of its head's first row: past a prompt prefix the target
        # reused (the prompt cache), whose hidden states were never computed here
        self._base: dict[int, int] = {}
        self._hidden: dict[int, tuple[int, torch.Tensor]] = {}  # target states not yet fed

    def _begin(self, slot: int, prompt: Sequence[int]) -> None:
        self._reset(slot)

    def _reset(self, slot: int) -> None:
        self.cache.truncate(slot, 0)
        self._exact[slot] = 0
        self._base.pop(slot, None)
        self._hidden.pop(slot, None)

    def _gather(self, slot: int) -> tuple[int, torch.Tensor]:
        """The target hidden states for positions from the slot's exact MTP rows on."""
        p, rows = self.target.take_hidden(slot)
        if slot in self._hidden and self._hidden[slot][0] <= p:
            q, old = self._hidden[slot]  # states held from before; the new ones win
            p, rows = q, torch.cat((old[: p - q], rows))
        exact = self._exact.get(slot, 0)
        if p > exact and exact == self._base.get(slot, 0):
            # a reused prompt prefix: the head starts after it, its rows' positions shifted
            # alike (rotary attention sees only their distances); it looks mostly a few rows
            # back (docs/perf/2026-12-04-head-context.md), so little is lost
            self._base[slot] = self._exact[slot] = exact = p
        if p > exact:  # states of positions the head was fed up to never came
            raise RuntimeError(f"slot {slot}: target hidden states start at {p}, need {exact}")
        self._hidden[slot] = (exact, rows[exact - p :])
        return self._hidden[slot]

    def _catch_up(self, req: DraftRequest) -> tuple[list[int], torch.Tensor]:
        """Rows to feed: tokens x_{i+1} and target states h_i for i = exact .. n - 2."""
        exact, hidden = self._gather(req.slot)
        # drop last step's approximate rows
        self.cache.truncate(req.slot, exact - self._base.get(req.slot, 0))
        n_rows = len(req.tokens) - 1 - exact
        if n_rows < 1 or hidden.shape[0] < n_rows:
            raise RuntimeError(f"slot {req.slot}: the target's hidden states are missing")
        tokens = list(req.tokens[exact + 1 :])
        self._exact[req.slot] = exact + n_rows
        self._hidden[req.slot] = (exact + n_rows, hidden[n_rows:])
        return tokens, hidden[:n_rows]

    def _forward(
        self, slots: list[int], tokens: list[list[int]], hidden: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One head forward over every slot's rows -> per slot (logits of its last row over
        the head's vocabulary [Vd], the state its next draft step is fed [D])."""
        raise NotImplementedError

    def _rows(self, slots: list[int], tokens: list[list[int]]) -> tuple[FlatBatch, torch.Tensor]:
        """A head step's rows: each slot's tokens as a batch from its cache's length on, and
        their ids, on the head's device."""
        starts = [self.cache.lengths[s] for s in slots]
        batch = FlatBatch.build(slots, starts, [len(t) for t in tokens], self.device)
        return batch, torch.tensor([t for ts in tokens for t in ts], device=self.device)

    def _target_id(self, token: int) -> int:
        """A token of the head's vocabulary as the target's (the same where they are one)."""
        return token

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the head's vocabulary [Vd] -> over the target's [V]."""
        return logits

    @torch.inference_mode()
    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = {r.slot: Draft() for r in requests}
        asks = {r.slot: r for r in requests}
        probs: dict[int, list[torch.Tensor]] = {r.slot: [] for r in requests}
        asked = [r for r in requests if r.n_max > 0]
        rows = [self._catch_up(r) for r in asked]
        slots = [r.slot for r in asked]
        tokens = [t for t, _ in rows]
        hidden = [h for _, h in rows]
        while slots:
            nxt: tuple[list[int], list[list[int]], list[torch.Tensor]] = ([], [], [])
            for slot, (logits, h) in zip(slots, self._forward(slots, tokens, hidden), strict=True):
                req, draft = asks[slot], drafts[slot]
                if self.sample_drafts and req.temperature > 0:
                    tok, q = self._sample(req, logits, len(draft))
                    probs[slot].append(q)
                    draft.tokens.append(tok)
                else:
                    # the head's runners-up come beside its token: where its top-1 misses,
                    # its top-2 is often the target's (docs/perf/2026-12-04-head-context.md)
                    (best, p), *others = top_tokens(logits, 1 + req.alternatives)
                    if not draft:  # the first token at any confidence, which labels the draft
                        draft.tier = confidence_tier(p)
                    elif req.p_min > 0 and p < req.p_min:
                        continue  # later ones where the head is sure enough (llama.cpp's p_min)
                    tok = self._target_id(best)
                    draft.add(tok, [(self._target_id(t), q) for t, q in others])
                if len(draft) < req.n_max:
                    nxt[0].append(slot)
                    nxt[1].append([tok])
                    nxt[2].append(h[None])
            slots, tokens, hidden = nxt
        for slot, qs in probs.items():
            if qs:
                drafts[slot].probs = torch.stack(qs)
        return [drafts[r.slot] for r in requests]

    def _sample(self, req: DraftRequest, logits: torch.Tensor, j: int) -> tuple[int, torch.Tensor]:
        """Draft token j of a sampled request: a draw from q = softmax(logits / temperature)
        over the target's vocabulary with the request's seeded draft stream, and q. (A
        greedy draft stays in the head's own vocabulary: mapping 150k logits per ask cost a
        head more than its LM head.)"""
        q = torch.softmax(self._target_logits(logits).double() / req.temperature, dim=-1)
        u = position_uniforms([req.seed], [len(req.tokens) + j], Stream.DRAFT, q.device)
        return int(sample_from_probs(q[None], u)[0]), q


def confidence_tier(p: float) -> int:
    """A draft's tier (rates.py) from the head's probability of its first token: 1 (under
    the first of CONFIDENCE) to len(CONFIDENCE) + 1. Sampled drafts keep tier 0."""
    return 1 + bisect.bisect_right(CONFIDENCE, p)


class MtpSpeculator(HiddenStateDrafter):
    name = "mtp"

    @classmethod
    def from_runner(cls, runner: MtpTarget) -> MtpSpeculator:
        """Draft with the MTP head of the model the target runner runs."""
        mem = runner.memory
        return cls(runner, runner.model, mem.num_slots, mem.max_len)

    def __init__(self, target: HiddenSource, model: MtpModel, num_slots: int, max_len: int) -> None:
        if model.mtp is None:
            raise ValueError("the model has no multi-token-prediction layers")
        # one draft step costs about one decoder layer plus the lm_head, of the whole target
        n_layers = len(getattr(model, "layers", [])) or 1
        super().__init__(target, model.mtp.new_cache(num_slots, max_len), 1.0 / (n_layers + 1))
        self.head, self.model = model.mtp, model
        target.record_hidden = True  # from now on the runner keeps final hidden states
        self.device = self.head.fc.weight.device

    def _forward(
        self, slots: list[int], tokens: list[list[int]], hidden: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One head forward over every slot's rows -> per slot (logits of its last row [V],
        the head's hidden state of its last row [D])."""
        batch, ids = self._rows(slots, tokens)
        last = self.head.forward_last(self.model.embed(ids), torch.cat(hidden), batch, self.cache)
        return list(zip(self.model.logits(last), last, strict=True))
