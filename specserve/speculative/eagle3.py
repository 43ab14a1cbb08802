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

from specserve.batch import FlatBatch
from specserve.models.eagle3 import Eagle3Head
from specserve.models.layers.embedding import rows_dtype_device
from specserve.models.size import step_bytes
from specserve.speculative.base import DraftRequest
from specserve.speculative.mtp import HiddenSource, HiddenStateDrafter, SlotMemory


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
        starts = [self.cache.lengths[s] for s in slots]
        batch = FlatBatch.build(slots, starts, [len(t) for t in tokens], self.device)
        ids = torch.tensor([t for ts in tokens for t in ts], device=self.device)
        normed, prenorm = self.head(self.embed(ids), torch.cat(hidden), batch, self.cache)
        last = [c - 1 for c in batch.cu_seqlens[1:]]
        return list(zip(self.head.lm_head(normed[last]), prenorm[last], strict=True))

    def _target_id(self, token: int) -> int:
        return self._d2t[token]

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head.target_logits(logits[None], self.vocab_size)[0]
