"""Memory: one facade over every kind of per-slot model state.

Attention KV rolls back by truncation; recurrent state (Gated DeltaNet conv + SSM) rolls
back to a restore point: a per-token snapshot, a checkpoint, or the start (see
cache/recurrent.py). The runner and engine only ever say `commit(slot, n_keep)`; whoever
wants to roll back further than the restore points reach asks `restorable(slot, n)` for
the nearest point and re-feeds the tokens after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.cache.kv import KVCache
from specserve.cache.recurrent import HybridCache, RecurrentCache


@dataclass
class SlotState:
    """A slot's whole state after `length` tokens, detached from any slot.

    kv: per attention layer (k, v), each [length, n_kv_heads, head_dim];
    conv: per Gated DeltaNet layer [C, W - 1]; ssm: per Gated DeltaNet layer [HV, K, V].
    """

    length: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    conv: list[torch.Tensor] = field(default_factory=list)
    ssm: list[torch.Tensor] = field(default_factory=list)


class Memory:
    def __init__(self, cache: KVCache | HybridCache) -> None:
        """cache: what the model's forward takes (`model.new_cache(...)`)."""
        self.cache = cache
        self.kv = cache.kv if isinstance(cache, HybridCache) else cache
        self.recurrent: RecurrentCache | None = (
            cache.recurrent if isinstance(cache, HybridCache) else None
        )

    @property
    def num_slots(self) -> int:
        return self.kv.num_slots

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    def length(self, slot: int) -> int:
        """Tokens of the slot's sequence whose state is held."""
        return self.kv.lengths[slot]

    def restorable(self, slot: int, n: int) -> int:
        """The largest m <= n that `commit(slot, m)` can return to (n itself for KV-only
        models; for recurrent ones the nearest snapshot, checkpoint or the start)."""
        if self.recurrent is None:
            return min(n, self.length(slot))
        points = self.recurrent.restore_points(slot, self.length(slot))
        return max(p for p in points if p <= n)

    def checkpoint(self, slot: int) -> None:
        """Make the slot's current length a restore point (a copy of its recurrent state;
        attention KV needs none)."""
        if self.recurrent is not None:
            self.recurrent.checkpoint(slot, self.length(slot))

    def commit(self, slot: int, n_keep: int, moved: int | None = None) -> None:
        """Keep the first n_keep tokens of the slot's sequence; forget the rest.

        n_keep must be restorable (see `restorable`); it always is for KV-only models.
        moved: where the last kept token is stored, if past its place (an alternative kept,
        batch.py `branches`: KV-only models alone verify them)."""
        length = self.length(slot)
        if not 0 <= n_keep <= length:
            raise ValueError(f"slot {slot}: cannot keep {n_keep} of {length} tokens")
        if moved is not None:
            if self.recurrent is not None:
                raise ValueError("a recurrent state cannot take back an alternative's row")
            self.kv.move(slot, moved, n_keep - 1)
        if self.recurrent is not None:
            self.recurrent.rollback(slot, n_keep, length)
        self.kv.truncate(slot, n_keep)

    def free(self, slot: int) -> None:
        self.kv.truncate(slot, 0)
        if self.recurrent is not None:
            self.recurrent.reset(slot)

    def copy_slot(self, src: int, dst: int, n: int | None = None) -> None:
        """Make dst hold what src holds after its first n tokens (default: all it holds):
        attention KV and recurrent state, with src's restore points up to n; whatever dst
        held is forgotten. n must be restorable in src (see `restorable`). Several samples
        of one prompt share its prefill this way (engine/samples.py)."""
        length = self.length(src)
        n = length if n is None else n
        if src == dst:
            raise ValueError(f"slot {src}: cannot copy a slot onto itself")
        if not 0 <= n <= length or self.restorable(src, n) != n:
            raise ValueError(f"slot {src}: no restore point at {n} of its {length} tokens")
        self.kv.copy(src, dst, n)
        if self.recurrent is not None:
            self.recurrent.copy(src, dst, n, length)

    def save(self, slot: int) -> SlotState:
        """A copy of everything the slot holds (for prompt-cache reuse)."""
        n = self.length(slot)
        layers = zip(self.kv.k, self.kv.v, strict=True)
        kv = [(k[slot, :n].clone(), v[slot, :n].clone()) for k, v in layers]
        if self.recurrent is None:
            return SlotState(n, kv)
        conv, ssm = self.recurrent.save(slot)
        return SlotState(n, kv, conv, ssm)

    def restore(self, slot: int, state: SlotState) -> None:
        """Put a saved state into a slot (any slot, whatever it held before)."""
        if state.length > self.max_len:
            raise ValueError(f"a {state.length}-token state does not fit {self.max_len} positions")
        n = state.length
        for layer, (k, v) in enumerate(state.kv):
            self.kv.k[layer][slot, :n] = k
            self.kv.v[layer][slot, :n] = v
        self.kv.lengths[slot] = n
        if self.recurrent is not None:
            self.recurrent.load(slot, state.conv, state.ssm)

    def nbytes_of(self, slot: int) -> int:
        """Bytes a `save` of the slot takes: its KV up to its length, its recurrent state."""
        n = self.length(slot)
        kv = sum(2 * t[slot, :n].numel() * t.element_size() for t in self.kv.k)
        if self.recurrent is None:
            return kv
        rec = self.recurrent
        return kv + sum(t[slot].numel() * t.element_size() for t in rec.conv + rec.ssm)

    def read_kv(self, slot: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the slot's attention KV for positions start .. end - 1, per layer."""
        if not 0 <= start <= end <= self.length(slot):
            raise ValueError(f"slot {slot}: no KV at {start}..{end} of {self.length(slot)}")
        layers = zip(self.kv.k, self.kv.v, strict=True)
        return [(k[slot, start:end].clone(), v[slot, start:end].clone()) for k, v in layers]

    def load_prefix(
        self,
        slot: int,
        pieces: list[list[tuple[torch.Tensor, torch.Tensor]]],
        n: int,
        recurrent: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> None:
        """Fill a slot with the first n positions of consecutive KV pieces (each per layer
        (k, v) [len, heads, dim]) and, for a recurrent model, the state after exactly n
        tokens; whatever the slot held is forgotten."""
        if n > self.max_len:
            raise ValueError(f"a {n}-token state does not fit {self.max_len} positions")
        if (self.recurrent is not None) != (recurrent is not None):
            raise ValueError("a recurrent model's slot needs its recurrent state, and only it")
        self.free(slot)
        pos = 0
        for piece in pieces:
            take = min(n - pos, piece[0][0].shape[0]) if piece else 0
            for layer, (k, v) in enumerate(piece):
                self.kv.k[layer][slot, pos : pos + take] = k[:take]
                self.kv.v[layer][slot, pos : pos + take] = v[:take]
            pos += take
        if pos != n:
            raise ValueError(f"the pieces hold {pos} positions, not {n}")
        self.kv.lengths[slot] = n
        if self.recurrent is not None and recurrent is not None:
            self.recurrent.load(slot, *recurrent)

    def nbytes(self) -> dict[str, int]:
        """Bytes held: attention KV, and recurrent live states, snapshots and checkpoints."""
        out = {"kv": self.kv.nbytes()}
        if self.recurrent is not None:
            out |= {f"recurrent_{k}": v for k, v in self.recurrent.nbytes().items()}
        return out
