"""`eagle3`: an EAGLE-3 head (models/eagle3.py) drafts from three of the target's layers.

It works as `mtp` does (speculative/mtp.py `HiddenStateDrafter`): the runner taps the
head's layers in the verify forward it runs anyway (`tap_layers`, no second target pass),
every step first feeds the rows those exact states make possible, then drafts
autoregressively from the head's own pre-norm state, all slots in one forward per draft
position; its KV rows past the exact ones are dropped next step. Drafts are argmax tokens
without probabilities, so verification keeps speculation on == off token for token; with
`sample_drafts` (--draft-probs) a sampled request's drafts are drawn from the head's
distribution and verified by rejection sampling (the same distribution, not the same text).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from specserve.models.eagle3 import Eagle3Head, HeadCalibration
from specserve.models.layers.embedding import rows_dtype_device
from specserve.models.size import step_bytes
from specserve.speculative.base import DraftRequest
from specserve.speculative.mtp import (
    CONFIDENCE,
    HiddenSource,
    HiddenStateDrafter,
    SlotMemory,
    class_rates,
)
from specserve.speculative.rates import ANY, AcceptanceModel

# how many held-out rows' worth a class's promised probability counts for beside its
# measured share: a class the held-out text hardly drew keeps near its promise
CALIBRATION_WEIGHT = 8


class Eagle3Target(HiddenSource, Protocol):
    """The target's runner: its model (embedding, sizes), memory and layer taps."""

    @property
    def model(self) -> Any: ...

    @property
    def memory(self) -> SlotMemory: ...

    def tap_layers(self, layers: tuple[int, ...]) -> None: ...


class Eagle3Speculator(HiddenStateDrafter):
    name = "eagle3"

    def __init__(
        self,
        target: Eagle3Target,
        head: Eagle3Head,
        relative_cost: float | None = None,
        sample_drafts: bool = False,
    ) -> None:
        """relative_cost: one draft step in target steps; by default the share of weight
        bytes it reads, decoding being memory-bound. sample_drafts: see HiddenStateDrafter."""
        model, mem = target.model, target.memory
        cost = relative_cost
        if cost is None:
            cost = step_bytes(head) / max(1, step_bytes(model))
        self.embed = head.embed if head.embed is not None else model.embed
        dtype, self.device = rows_dtype_device(self.embed)
        cache = head.new_cache(mem.num_slots, mem.max_len, dtype)
        super().__init__(target, cache, cost, sample_drafts)
        target.tap_layers(head.cfg.aux_layers)
        measured = calibrated_rates(head.calibration)
        if measured is not None:  # the head's own record, in place of its classes' midpoints
            self.rates = AcceptanceModel(*measured)
        self.head, self.model = head, model
        self.vocab_size = int(model.cfg.vocab_size)
        self._d2t: list[int] = head.d2t.tolist()  # read per draft token: a list, not a tensor

    def _catch_up(self, req: DraftRequest) -> tuple[list[int], torch.Tensor]:
        tokens, aux = super()._catch_up(req)
        return tokens, self.head.fuse(aux)  # [n, 3 * H_target] -> the head's [n, H]

    def _forward(
        self, slots: list[int], tokens: list[list[int]], hidden: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One head forward over every slot's rows -> per slot (draft-vocabulary logits of
        its last row [Vd], its pre-norm state [H], the next draft step's input)."""
        batch, ids = self._rows(slots, tokens)
        head = self.head
        normed, prenorm = head.forward_last(self.embed(ids), torch.cat(hidden), batch, self.cache)
        return list(zip(head.lm_head(normed), prenorm, strict=True))

    def _target_id(self, token: int) -> int:
        return self._d2t[token]

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head.target_logits(logits[None], self.vocab_size)[0]


def calibrated_rates(
    cal: HeadCalibration | None,
) -> tuple[dict[int, float], float, dict[int, float]] | None:
    """A head's first_rates, prior and first_shares (rates.py) from what train-head
    measured on held-out text: each class's kept share of its first tokens (`ANY`: of all
    of them), and the kept share of later ones for the prior, each counted as
    CALIBRATION_WEIGHT more rows at what the head's probabilities promise; and the share of
    its first tokens in each class. None where the head has no record of these classes.
    Priced by the midpoints, a head whose middle classes keep less than they promise was
    verified, and paid for, in each class until its record of the answer caught up
    (docs/perf/2026-11-28-head-calibration.md)."""
    if cal is None or cal.bounds != CONFIDENCE:
        return None
    promised = class_rates(CONFIDENCE)
    w = CALIBRATION_WEIGHT
    first = {
        tier: (kept + w * promised[tier]) / (rows + w)
        for tier, kept, rows in zip(promised, cal.first_kept, cal.first_rows, strict=True)
    }
    # a sampled draft (tier 0) has no class: its first token is judged as all of them are
    first[ANY] = first[0] = (sum(cal.first_kept) + w * 0.5) / (sum(cal.first_rows) + w)
    later = (cal.later_kept + w * cal.p_min) / (cal.later_rows + w)
    rows = sum(cal.first_rows)
    shares = (
        {tier: n / rows for tier, n in zip(promised, cal.first_rows, strict=True)} if rows else {}
    )
    return first, later, shares
