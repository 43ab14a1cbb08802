"""Attention KV cache: one fixed buffer per layer, one row of it per slot.

Rollback of a slot is truncation: its length goes down and later writes overwrite the rest.
"""

from __future__ import annotations

import torch

from specserve.batch import FlatBatch
from specserve.errors import SpecserveError


class KVCache:
    """k[layer], v[layer]: [n_slots, max_len, n_kv_heads, head_dim]; lengths[slot]: tokens kept."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.lengths = [0] * num_slots

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def check_room(self, batch: FlatBatch) -> None:
        for slot, start, n in zip(batch.slots, batch.starts, batch.lens(), strict=True):
            if start != self.lengths[slot]:
                raise RuntimeError(
                    f"slot {slot}: batch starts at {start}, cache holds {self.lengths[slot]}"
                )
            if start + n > self.max_len:
                raise SpecserveError(
                    f"context overflow: slot {slot} needs {start + n} positions, "
                    f"the context holds {self.max_len}"
                )

    def write(self, layer: int, batch: FlatBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, n_kv_heads, head_dim] for the batch's rows, stored at their positions."""
        cu = batch.cu_seqlens
        for i, (slot, start) in enumerate(zip(batch.slots, batch.starts, strict=True)):
            n = cu[i + 1] - cu[i]
            self.k[layer][slot, start : start + n] = k[cu[i] : cu[i + 1]]
            self.v[layer][slot, start : start + n] = v[cu[i] : cu[i + 1]]

    def advance(self, batch: FlatBatch) -> None:
        """After a forward: every slot of the batch now holds its new tokens too."""
        for slot, start, n in zip(batch.slots, batch.starts, batch.lens(), strict=True):
            self.lengths[slot] = start + n

    def copy(self, src: int, dst: int, n: int) -> None:
        """Make dst hold src's first n tokens (whatever dst held before is forgotten)."""
        if not 0 <= n <= self.lengths[src]:
            raise ValueError(f"slot {src}: cannot copy {n} of {self.lengths[src]} tokens")
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :n] = k[src, :n]
            v[dst, :n] = v[src, :n]
        self.lengths[dst] = n

    def move(self, slot: int, src: int, dst: int) -> None:
        """Put the slot's row src at dst in every layer (an alternative kept: batch.py
        `branches`); what was at dst is forgotten."""
        if not 0 <= dst < src < self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot move row {src} to {dst}")
        for k, v in zip(self.k, self.v, strict=True):
            k[slot, dst] = k[slot, src]
            v[slot, dst] = v[slot, src]

    def truncate(self, slot: int, n_keep: int) -> None:
        if not 0 <= n_keep <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot keep {n_keep} of {self.lengths[slot]} tokens")
        self.lengths[slot] = n_keep
