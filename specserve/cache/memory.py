"""Memory: one facade over every kind of per-slot model state.

Today that is attention KV (rollback = truncate); recurrent state (snapshots, checkpoints)
joins behind the same calls. The runner and engine only ever say `commit(slot, n_keep)`.
"""

from __future__ import annotations

from specserve.cache.kv import KVCache


class Memory:
    def __init__(self, kv: KVCache) -> None:
        self.kv = kv

    @property
    def num_slots(self) -> int:
        return self.kv.num_slots

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    def length(self, slot: int) -> int:
        """Tokens of the slot's sequence whose state is held."""
        return self.kv.lengths[slot]

    def commit(self, slot: int, n_keep: int) -> None:
        """Keep the first n_keep tokens of the slot's sequence; forget the rest."""
        self.kv.truncate(slot, n_keep)

    def free(self, slot: int) -> None:
        self.kv.truncate(slot, 0)
