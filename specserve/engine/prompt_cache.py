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
"""

from __future__ import annotations

from collections.abc import Sequence

from specserve.cache.memory import Memory
from specserve.tokens import shared_prefix


class PromptCache:
    """Which tokens each free slot's memory still holds; picks and prepares slots."""

    def __init__(self, memory: Memory, enabled: bool = True) -> None:
        self.memory = memory
        self.enabled = enabled
        self._held: dict[int, list[int]] = {}  # free slot -> the tokens its memory holds
        self._salts: dict[int, str | None] = {}  # free slot -> the salt of who left them

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
        if n == 0:
            unused = [s for s in free if not self._held.get(s)]
            slot = unused[-1] if unused else free[0]
        self._held.pop(slot, None)
        self._settle(slot, n)
        return slot, n

    def clear(self) -> None:
        """Forget every held prefix (after an engine failure the memory is suspect)."""
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
