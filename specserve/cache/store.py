"""The prompt store: slot states kept in host memory after their slot is reused, under a
byte budget, least recently used evicted first (llama.cpp's `--cache-ram`).

An entry is one sequence's state: its tokens, its attention KV, and for a recurrent
(hybrid) model the conv + SSM state after exactly its last token. KV is stored in blocks of
`block` tokens in a tree keyed by (parent block, the block's tokens), so entries that share
a prefix (a system prompt, earlier turns of one conversation) share its blocks, stored
once; only the last partial block is an entry's own. A block's KV depends only on the
tokens up to its end (the kernels are batch-invariant), so sharing is exact.

Matching: the longest prefix an entry can give a prompt, of the same tenant (`salt`):
any shared length for attention-only models; for recurrent ones only the entry's full
length, the one position whose recurrent state it holds. docs/prompt-store.md says why this
design and what it costs.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specserve.cache.memory import Memory
from specserve.tokens import shared_prefix

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), [len, heads, dim]
BlockKey = tuple[object, tuple[int, ...]]  # (parent block id, or the tenant at the root; tokens)

DEFAULT_BLOCK = 64
DEFAULT_CAP = 8 * 2**30  # llama.cpp's default --cache-ram
DEFAULT_SHARE = 0.25  # of MemAvailable, when the budget is not given


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes the machine can still give without swapping (Linux's MemAvailable); None where
    the figure cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_budget(meminfo: str = "/proc/meminfo") -> int:
    """Bytes for the store when --cache-ram is not given: a quarter of MemAvailable, at
    most llama.cpp's 8 GiB (0 where the figure cannot be read: no store)."""
    free = available_memory(meminfo)
    return 0 if free is None else min(DEFAULT_CAP, int(free * DEFAULT_SHARE))


def _host(kv: KV) -> KV:
    """The store lives in host memory whatever device the slots are on."""
    return [(k.to("cpu"), v.to("cpu")) for k, v in kv]


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _kv_bytes(kv: KV) -> int:
    return sum(_nbytes(pair) for pair in kv)


@dataclass
class _Block:
    key: BlockKey
    kv: KV
    nbytes: int
    users: int = 0


@dataclass
class Entry:
    """One saved sequence: `blocks` (shared, full) then its own `tail` KV; `recurrent`:
    (conv, ssm) per Gated DeltaNet layer after all its tokens; `extra`: what the engine
    saved beside it (speculator state), `extra_bytes` its size."""

    tokens: tuple[int, ...]
    salt: str | None
    blocks: list[int]
    tail: KV
    recurrent: tuple[list[torch.Tensor], list[torch.Tensor]] | None
    extra: object = None
    extra_bytes: int = 0
    own_bytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        rec = _nbytes([*self.recurrent[0], *self.recurrent[1]]) if self.recurrent else 0
        self.own_bytes = _kv_bytes(self.tail) + rec + self.extra_bytes


class PromptStore:
    """Entries in LRU order under `budget` bytes (0: stores nothing)."""

    def __init__(self, budget: int, block: int = DEFAULT_BLOCK) -> None:
        if budget < 0 or block < 1:
            raise ValueError(f"need budget >= 0 and block >= 1, got {budget} and {block}")
        self.budget, self.block = budget, block
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._blocks: dict[int, _Block] = {}
        self._index: dict[BlockKey, int] = {}
        self._ids = itertools.count()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    # matching ---------------------------------------------------------------------------
    def usable(self, entry: Entry, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` the entry can give: the shared prefix, less the prompt's last
        token (always fed); for a recurrent entry all its tokens or none."""
        n = min(shared_prefix(entry.tokens, prompt), len(prompt) - 1)
        if entry.recurrent is not None and n != len(entry.tokens):
            return 0
        return max(n, 0)

    def match(self, prompt: Sequence[int], salt: str | None) -> tuple[int | None, int]:
        """(entry id, n) of the entry giving the most tokens of `prompt`; (None, 0) if none."""
        best, n_best = None, 0
        for eid, entry in self.entries.items():
            if entry.salt == salt:
                n = self.usable(entry, prompt)
                if n > n_best:
                    best, n_best = eid, n
        return best, n_best

    def holds(self, tokens: Sequence[int], salt: str | None, recurrent: bool) -> int | None:
        """An entry that already holds this state: the same tokens, or for attention-only
        models any entry they are a prefix of."""
        want = tuple(tokens)
        for eid, e in self.entries.items():
            same = e.tokens == want or (not recurrent and e.tokens[: len(want)] == want)
            if e.salt == salt and same:
                return eid
        return None

    # saving -----------------------------------------------------------------------------
    def save(
        self,
        memory: Memory,
        slot: int,
        tokens: Sequence[int],
        salt: str | None,
        side: Callable[[], tuple[object, int]] | None = None,
    ) -> bool:
        """Keep what `slot` holds (its memory holds exactly `tokens`), unless it is held
        already or does not fit the budget. Returns whether the state is in the store.
        `side()` gives what the engine keeps beside it, (state, bytes); it is asked only
        when a new entry is made, as it may copy a draft model's memory."""
        if self.budget == 0 or not tokens:
            return False
        if memory.length(slot) != len(tokens):
            raise ValueError(f"slot {slot} holds {memory.length(slot)} tokens, not {len(tokens)}")
        recurrent = memory.recurrent is not None
        held = self.holds(tokens, salt, recurrent)
        if held is not None:
            self.entries.move_to_end(held)
            return True
        shared = self._chain(tokens, salt)
        for bid in shared:  # pinned: eviction below must not free what the entry reuses
            self._blocks[bid].users += 1
        stored = self._store(memory, slot, tokens, salt, shared, side)
        for bid in shared:
            self._release(bid)
        if stored and not recurrent:  # an attention-only entry covers those it extends
            self._drop_prefixes_of(tokens, salt)
        return stored

    def _store(
        self,
        memory: Memory,
        slot: int,
        tokens: Sequence[int],
        salt: str | None,
        shared: list[int],
        side: Callable[[], tuple[object, int]] | None,
    ) -> bool:
        n_full = len(tokens) // self.block * self.block
        tail = _host(memory.read_kv(slot, n_full, len(tokens)))
        rec = None
        if memory.recurrent is not None:
            conv, ssm = memory.recurrent.save(slot)
            rec = [t.to("cpu") for t in conv], [t.to("cpu") for t in ssm]
        entry = Entry(tuple(tokens), salt, list(shared), tail, rec, *(side() if side else ()))
        n_missing = n_full // self.block - len(shared)
        need = entry.own_bytes + self._block_bytes(memory) * n_missing
        if need > self.budget:
            return False
        while self.bytes + need > self.budget:
            self._evict_oldest()
        parent: object = shared[-1] if shared else ("tenant", salt)
        for start in range(len(shared) * self.block, n_full, self.block):
            key = (parent, tuple(tokens[start : start + self.block]))
            kv = _host(memory.read_kv(slot, start, start + self.block))
            parent = self._add_block(key, kv)
            entry.blocks.append(parent)
        for bid in entry.blocks:
            self._blocks[bid].users += 1
        self.bytes += entry.own_bytes
        self.entries[next(self._ids)] = entry
        return True

    def _chain(self, tokens: Sequence[int], salt: str | None) -> list[int]:
        """Ids of the stored blocks that begin `tokens` (the tree's path along them)."""
        chain: list[int] = []
        parent: object = ("tenant", salt)
        for start in range(0, len(tokens) - self.block + 1, self.block):
            bid = self._index.get((parent, tuple(tokens[start : start + self.block])))
            if bid is None:
                break
            chain.append(bid)
            parent = bid
        return chain

    def _block_bytes(self, memory: Memory) -> int:
        k = memory.kv.k
        return sum(2 * t[0, : self.block].numel() * t.element_size() for t in k)

    def _add_block(self, key: BlockKey, kv: KV) -> int:
        bid = next(self._ids)
        self._blocks[bid] = _Block(key, kv, _kv_bytes(kv))
        self._index[key] = bid
        self.bytes += self._blocks[bid].nbytes
        return bid

    def _release(self, bid: int) -> None:
        block = self._blocks[bid]
        block.users -= 1
        if block.users == 0:
            del self._blocks[bid], self._index[block.key]
            self.bytes -= block.nbytes

    def _remove(self, eid: int) -> None:
        entry = self.entries.pop(eid)
        for bid in entry.blocks:
            self._release(bid)
        self.bytes -= entry.own_bytes

    def _evict_oldest(self) -> None:
        eid = next(iter(self.entries))
        self._remove(eid)
        self.evictions += 1

    def _drop_prefixes_of(self, tokens: Sequence[int], salt: str | None) -> None:
        want = tuple(tokens)
        for eid, e in list(self.entries.items()):
            if e.salt == salt and len(e.tokens) < len(want) and want[: len(e.tokens)] == e.tokens:
                self._remove(eid)

    # restoring --------------------------------------------------------------------------
    def restore(self, memory: Memory, slot: int, eid: int, n: int) -> Entry:
        """Put the entry's first n tokens of state into `slot` (n from `usable`); the entry
        becomes the most recently used. Returns it (its extra goes back to the engine)."""
        entry = self.entries[eid]
        if entry.recurrent is not None and n != len(entry.tokens):
            raise ValueError(f"a recurrent entry holds its state at {len(entry.tokens)}, not {n}")
        pieces = [self._blocks[bid].kv for bid in entry.blocks] + [entry.tail]
        memory.load_prefix(slot, pieces, n, entry.recurrent)
        self.entries.move_to_end(eid)
        self.hits += 1
        self.hit_tokens += n
        return entry

    def count_miss(self) -> None:
        """A prompt that neither a slot nor an entry gave anything."""
        self.misses += 1

    def clear(self) -> None:
        for eid in list(self.entries):
            self._remove(eid)

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self.entries),
            "blocks": len(self._blocks),
            "bytes": self.bytes,
            "budget": self.budget,
            "hits": self.hits,
            "misses": self.misses,
            "hit_tokens": self.hit_tokens,
            "evictions": self.evictions,
        }
