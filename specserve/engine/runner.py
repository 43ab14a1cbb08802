"""ModelRunner: turns per-slot token lists into one flat forward and hands back logits.

It owns the model and its memory. A step's work is a list of SlotInput (prompt chunks and
verification rows alike); the runner concatenates them into one FlatBatch, runs the model
once, and returns each slot's logits for the rows it asked for.
"""

from __future__ import annotations

import torch

from specserve.cache.memory import Memory
from specserve.errors import SpecserveError
from specserve.models.batch import FlatBatch, SlotInput
from specserve.models.llama import DenseTransformer

__all__ = ["ModelRunner", "SlotInput"]


class ModelRunner:
    def __init__(self, model: DenseTransformer, num_slots: int, max_len: int) -> None:
        if max_len > model.cfg.context_length:
            raise SpecserveError(
                f"context size {max_len} exceeds the model's {model.cfg.context_length}"
            )
        self.model = model
        self.memory = Memory(model.new_cache(num_slots, max_len))
        self.device = model.embed.weight.device

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @torch.inference_mode()
    def forward(self, work: list[SlotInput]) -> list[torch.Tensor]:
        """One forward over every slot's new tokens -> per slot logits [n_logits, V]."""
        starts = [self.memory.length(w.slot) for w in work]
        lens = [len(w.tokens) for w in work]
        batch = FlatBatch.build([w.slot for w in work], starts, lens, self.device)
        flat = [t for w in work for t in w.tokens]
        tokens = torch.tensor(flat, dtype=torch.long, device=self.device)
        hidden = self.model(tokens, batch, self.memory.kv)
        rows = [
            r
            for w, end in zip(work, batch.cu_seqlens[1:], strict=True)
            for r in range(end - w.n_logits, end)
        ]
        logits = self.model.logits(hidden[rows])
        return list(logits.split([w.n_logits for w in work]))

    def commit(self, keeps: dict[int, int]) -> None:
        """After verification: slot -> how many tokens of its sequence to keep.

        All slots of a step commit together, so a rollback strategy that must re-run the
        kept tokens (checkpoint + replay) can do it in one batched forward.
        """
        for slot, n_keep in keeps.items():
            self.memory.commit(slot, n_keep)

    def prefill(self, slot: int, tokens: list[int], chunk: int = 512) -> torch.Tensor:
        """Feed a prompt in chunks (bounded activation memory) -> logits of its last token [V]."""
        logits = None
        for i in range(0, len(tokens), chunk):
            (logits,) = self.forward([SlotInput(slot, tokens[i : i + chunk])])
        if logits is None:
            raise SpecserveError("empty prompt")
        return logits[-1]
