"""ngram-mod: one hashed n-gram -> next-token table shared by all slots, drafts by chaining.

After llama.cpp's common/ngram-mod.{h,cpp} and its `ngram-mod` speculator (PR #19164):
- every n_match-gram of every slot's context is hashed (a 64-bit LCG-style polynomial) into
  a fixed table of `table_size` buckets holding the token that followed it; a later n-gram
  in the same bucket overwrites it (collisions are accepted: the table is only a guess, and
  verification keeps the output exact);
- a draft starts from the context's last n_match tokens, looks up the next token, slides
  the window over it and repeats, up to n_max tokens; a chain that breaks before n_min
  tokens gives no draft;
- the table is shared by all slots of a tenant (speculative/tenants.py), so their requests learn
  from each other; it is cleared when more than a quarter of it is in use at a slot's
  begin(), or after 5 drafts in a row of one slot had fewer than a quarter of their tokens
  accepted.

Differences from llama.cpp: a low round is judged against the draft length the engine was
really proposed (after n_max clipping; llama.cpp uses the length before its server clips),
and reset() forgets a slot's low-round streak.

Cost: constant memory (4 Mi int32 buckets = 16 MiB by default), a vectorised hash of the
new n-grams every 32 tokens, and one O(1) rolling-hash look-up per drafted token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specserve.speculative.base import Draft, DraftRequest, Speculator, slot_state
from specserve.speculative.ngram import check_positive
from specserve.speculative.tenants import PerTenant

_MULT = 6364136223846793005  # llama.cpp's hash multiplier (Knuth's MMIX LCG constant)
_MASK = (1 << 64) - 1

ADD_EVERY = 32  # a slot's new n-grams are added once it is this many tokens ahead [llama.cpp]
MAX_OCCUPANCY = 0.25  # begin() clears the table when more of it is in use [llama.cpp]
LOW_ACCEPT = 0.25  # a draft with a smaller accepted fraction counts as a low round [llama.cpp]
LOW_ROUNDS = 5  # this many low rounds in a row of one slot clear the table [llama.cpp]
MAX_TABLES = 4  # tenants whose tables are kept at once (speculative/tenants.py)


class NgramHashTable:
    """llama.cpp's `common_ngram_mod`: bucket(hash(n-gram)) -> the token that followed it.

    entries: [size] int32 token ids, EMPTY (-1) where nothing was stored.
    hash(w) = sum_k w[k] * MULT**(n-1-k) mod 2**64; bucket = hash % size.
    """

    EMPTY = -1

    def __init__(self, n: int, size: int = 4 * 1024 * 1024) -> None:
        check_positive(n=n, size=size)
        self.n, self.size = n, size
        self.entries = np.full(size, self.EMPTY, dtype=np.int32)
        self.used = 0  # buckets holding a token
        self._out_weight = pow(_MULT, n - 1, 1 << 64)  # weight of the token leaving the window

    @property
    def occupancy(self) -> float:
        return self.used / self.size

    def hash(self, window: Sequence[int]) -> int:
        """The 64-bit hash of an n-gram (window: [n] token ids)."""
        h = 0
        for t in window:
            h = (h * _MULT + t) & _MASK
        return h

    def add(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """Store, for each i in [start, stop), the n-gram tokens[i:i+n] -> tokens[i+n].

        tokens: [>= stop + n]. Vectorised; equal to adding the n-grams one by one in order.
        """
        count = stop - start
        if count <= 0:
            return
        arr = np.asarray(tokens[start : stop + self.n], dtype=np.uint64)  # [count + n]
        h = np.zeros(count, dtype=np.uint64)
        for k in range(self.n):  # uint64 arithmetic wraps, as the C++ size_t does
            h = h * np.uint64(_MULT) + arr[k : k + count]
        bucket = (h % np.uint64(self.size)).astype(np.int64)
        # the last n-gram written to a bucket wins, as in the one-by-one loop
        buckets, first_from_end = np.unique(bucket[::-1], return_index=True)
        last = count - 1 - first_from_end
        self.used += int(np.count_nonzero(self.entries[buckets] == self.EMPTY))
        self.entries[buckets] = arr[self.n :][last].astype(np.int32)

    def chain(self, window: Sequence[int], limit: int) -> list[int]:
        """Follow the table from `window` ([n] tokens) for up to `limit` tokens or a miss."""
        seq = [int(t) for t in window]
        h = self.hash(seq)
        for i in range(limit):
            token = int(self.entries[h % self.size])
            if token == self.EMPTY:
                break
            seq.append(token)
            # slide the window: drop seq[i], append token (exact mod 2**64)
            h = ((h - seq[i] * self._out_weight) * _MULT + token) & _MASK
        return seq[self.n :]

    def reset(self) -> None:
        self.entries.fill(self.EMPTY)
        self.used = 0


def build_ngram_mod_table(tokens: Sequence[int], n: int) -> dict[tuple[int, ...], int]:
    """Reference table without hashing: every n-gram of `tokens` -> the token after it.

    tokens: [L]; a later occurrence of an n-gram overwrites an earlier one.

    >>> build_ngram_mod_table([5, 1, 2, 1, 3], n=1)
    {(5,): 1, (1,): 3, (2,): 1}
    """
    return {tuple(tokens[i : i + n]): tokens[i + n] for i in range(len(tokens) - n)}


def ngram_mod_draft(
    table: Mapping[tuple[int, ...], int],
    tokens: Sequence[int],
    n_match: int = 24,
    n_min: int = 48,
    n_max: int = 64,
) -> list[int]:
    """Reference for `ngram-mod`: chain next-token look-ups from the last n_match tokens.

    No draft unless `len(tokens) - 1 >= n_match` (llama.cpp's `cur_len < n` rule); then up
    to n_max look-ups, each keyed by the last n_match tokens of context + draft so far. A
    chain that misses before n_min tokens gives no draft. `table` maps n_match-grams to a
    next token (`build_ngram_mod_table`; `NgramMod` keeps a hashed version of it).

    tokens: [L] context, newest token last. Returns the draft (possibly empty).

    Example (n_match=2): (1, 2) -> 3, (2, 3) -> 4, (3, 4) -> 9, (4, 9) is unknown.

    >>> table = build_ngram_mod_table([5, 1, 2, 3, 4, 9], n=2)
    >>> ngram_mod_draft(table, [8, 1, 2], n_match=2, n_min=2, n_max=8)
    [3, 4, 9]
    >>> ngram_mod_draft(table, [8, 1, 2], n_match=2, n_min=4, n_max=8)
    []
    """
    if len(tokens) - 1 < n_match:
        return []
    seq = list(tokens[len(tokens) - n_match :])
    for i in range(n_max):
        token = table.get(tuple(seq[i : i + n_match]))
        if token is None:
            return [] if i < n_min else seq[n_match:]
        seq.append(token)
    return seq[n_match:]


@dataclass
class _SeqInfo:
    """Per-slot bookkeeping [llama.cpp: seq_info]."""

    i_last: int = 0  # n-grams starting before this position are in the table
    n_low: int = 0  # consecutive drafts with a low accepted fraction


class NgramMod(Speculator):
    """`ngram-mod`: drafts from one `NgramHashTable` that every slot feeds and reads.

    n_match: n-gram length [--spec-ngram-size-n, 24; llama.cpp warns below 16];
    n_min: shorter chains give no draft [--draft-min, 48]; n_max: longest draft [--draft-max, 64];
    table_size: buckets of the shared table [4 Mi, 16 MiB].
    """

    name = "ngram-mod"

    def __init__(
        self, n_match: int = 24, n_min: int = 48, n_max: int = 64, table_size: int = 4 * 1024 * 1024
    ) -> None:
        super().__init__()
        check_positive(n_match=n_match, n_max=n_max, table_size=table_size)
        if isinstance(n_min, bool) or not isinstance(n_min, int) or not 0 <= n_min <= n_max:
            raise ValueError(f"n_min must be an integer in [0, n_max={n_max}], got {n_min!r}")
        self.n_match, self.n_min, self.n_max = n_match, n_min, n_max
        # one table per tenant (speculative/tenants.py), fewer kept than other speculators' state:
        # each is table_size buckets whether used or not
        self._tables = PerTenant(lambda: NgramHashTable(n_match, table_size), MAX_TABLES)
        self._seqs: dict[int, _SeqInfo] = {}

    @property
    def table(self) -> NgramHashTable:
        """The default tenant's table."""
        return self._tables[None]

    def _table(self, slot: int) -> NgramHashTable:
        return self._tables[self.tenant(slot)]

    def _begin(self, slot: int, prompt: Sequence[int]) -> None:
        super()._begin(slot, prompt)
        info = self._seqs[slot] = _SeqInfo()
        if len(prompt) < self.n_match:
            return
        table = self._table(slot)
        table.add(prompt, 0, len(prompt) - self.n_match)
        info.i_last = len(prompt) - self.n_match
        if table.occupancy > MAX_OCCUPANCY:  # a crowded table mostly returns collisions
            table.reset()

    def _reset(self, slot: int) -> None:
        super()._reset(slot)
        self._seqs.pop(slot, None)

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft(self._draft_one(req)) for req in requests]

    def _draft_one(self, req: DraftRequest) -> list[int]:
        info = slot_state(self._seqs, req.slot, _SeqInfo)
        tokens, n = req.tokens, self.n_match
        cur_len = len(tokens) - 1  # llama.cpp's history excludes the newest token
        if cur_len < n:
            return []
        table = self._table(req.slot)
        if info.i_last + ADD_EVERY < cur_len:  # in chunks: hashing is cheaper in bulk
            table.add(tokens, info.i_last, cur_len - n)
            info.i_last = max(info.i_last, cur_len - n)
        # the base class clips to req.n_max; chaining past it (but not below n_min) is wasted
        limit = min(self.n_max, max(req.n_max, self.n_min))
        draft = table.chain(tokens[len(tokens) - n :], limit)
        return draft if len(draft) >= self.n_min else []

    def _accept(self, slot: int, n_accepted: int, n_proposed: int) -> None:
        info = slot_state(self._seqs, slot, _SeqInfo)
        if n_accepted / n_proposed >= LOW_ACCEPT:
            info.n_low = 0
            return
        info.n_low += 1
        if info.n_low >= LOW_ROUNDS:  # the table has gone stale for this slot: start afresh
            self._table(slot).reset()
            info.n_low = 0
            info.i_last = 0  # re-add this slot's context at its next draft
