"""Prompt cache: a free slot keeps what its last request left in memory, and a new request
starts its prefill after the longest prefix it shares with that (llama.cpp's
`cache_prompt`; vLLM's prefix caching, one sequence per slot).

A follow-up chat turn re-sends the whole conversation; in the slot that served the turn
before, only the new message is prefilled. Requests that share a system prompt share its
prefill too. Reuse is exact where a token's state does not depend on how it was computed
(prefill chunk or decode row, which batch-mates): the CPU float32 kernels and
`--deterministic` guarantee that (tests/engine/test_prompt_cache.py).

Attention KV is kept to any length; recurrent state only to a point it can be restored to
(the slot's end, its checkpoint or a snapshot; cache/memory.py `restorable`), which is
exactly where a follow-up turn starts: after the previous answer.

Tenants: a prefix is reused only by a request with the same `salt` (vLLM's `cache_salt`),
so neither its speed nor `cached_tokens` tells one tenant what another's prompts were.

The prompt store (cache/store.py, `--cache-ram`): when a slot is given to a request that
does not continue what it holds, what it held is saved there first; a new request takes
the longest prefix the free slots or the store give, the store's restored into the slot.
Beside a saved state the engine may keep its own (`SideState`: a speculator's).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Protocol

from specserve.cache.memory import Memory
from specserve.cache.store import PromptStore
from specserve.tokens import shared_prefix


class SideState(Protocol):
    """What is saved and restored with a slot's state beside its memory (the speculator's
    per-slot state: a draft model's memory)."""

    def save_state(self, slot: int) -> tuple[object, int]: ...  # (state, bytes)
    def restore_state(self, slot: int, state: object) -> None: ...


class PromptCache:
    """Which tokens each free slot's memory still holds; picks and prepares slots."""

    def __init__(self, memory: Memory, enabled: bool = True) -> None:
        self.memory = memory
        self.enabled = enabled
        self._held: dict[int, list[int]] = {}  # free slot -> the tokens its memory holds
        self._salts: dict[int, str | None] = {}  # free slot -> the salt of who left them
        self.store: PromptStore | None = None
        self.side: SideState | None = None

    def use_store(self, store: PromptStore | None, side: SideState | None = None) -> None:
        """Save slots into `store` before reuse and restore from it (None: no store)."""
        usable = store is not None and store.budget > 0 and self.enabled
        self.store = store if usable else None
        self.side = side

    def keep(self, slot: int, context: Sequence[int], salt: str | None = None) -> None:
        """A request left `slot`: hold as much of its context as the memory can return to.

        The memory may hold less than the context (the newest token is never fed) or more
        (accepted drafts after a stop token); both are cut to what they share."""
        n = min(len(context), self.memory.length(slot)) if self.enabled else 0
        n = self.memory.restorable(slot, n)
        self._settle(slot, n)
        self._held[slot] = list(context[:n])
        self._salts[slot] = salt

    def take(
        self, free: Sequence[int], prompt: Sequence[int], use: bool = True, salt: str | None = None
    ) -> tuple[int, int]:
        """(slot, n): the free slot to run `prompt` in, prepared to keep the n prompt tokens
        that need no prefill and to forget the rest.

        The slot is the one holding the longest reusable prefix; else an unused slot (in
        `free`'s pop order), else the one freed longest ago, so recent conversations keep
        their prefixes for their next turn."""
        mine = [s for s in free if self._salts.get(s) == salt]
        usable = {s: self._usable(s, prompt) for s in mine} if use and self.enabled else {}
        slot = max(usable, key=usable.__getitem__, default=-1)
        n = usable.get(slot, 0)
        stored, n_stored = self._match_store(prompt, salt, n) if use and self.enabled else (None, 0)
        if n == 0 or stored is not None:
            unused = [s for s in free if not self._held.get(s)]
            slot = unused[-1] if unused else free[0]
        self._save(slot, n if stored is None else 0)
        self._held.pop(slot, None)
        if stored is not None and self.store is not None:
            entry = self.store.restore(self.memory, slot, stored, n_stored)
            if self.side is not None and entry.extra is not None:
                self.side.restore_state(slot, entry.extra)
            return slot, n_stored
        self._settle(slot, n)
        return slot, n

    def _match_store(
        self, prompt: Sequence[int], salt: str | None, n_slot: int
    ) -> tuple[int | None, int]:
        """The store's best entry for the prompt if it gives more than the best slot."""
        if self.store is None:
            return None, 0
        eid, n = self.store.match(prompt, salt)
        if eid is None or n <= n_slot:
            if n_slot == 0:
                self.store.count_miss()
            return None, 0
        return eid, n

    def _save(self, slot: int, n_kept: int) -> None:
        """The slot keeps only n_kept of what it holds: the rest goes to the store first."""
        held = self._held.get(slot, [])
        if self.store is None or len(held) <= n_kept:
            return
        side = partial(self.side.save_state, slot) if self.side is not None else None
        self.store.save(self.memory, slot, held, self._salts.get(slot), side)

    def clear(self) -> None:
        """Forget every held prefix (after an engine failure the memory is suspect); the
        store's entries were saved before and stay."""
        for slot in list(self._held):
            del self._held[slot]
            self._settle(slot, 0)

    def _usable(self, slot: int, prompt: Sequence[int]) -> int:
        # at least the prompt's last token is fed: its logits give the first new token
        n = min(shared_prefix(self._held.get(slot, ()), prompt), len(prompt) - 1)
        return self.memory.restorable(slot, max(n, 0))

    def _settle(self, slot: int, n: int) -> None:
        if n > 0:
            self.memory.commit(slot, n)
        else:
            self.memory.free(slot)
