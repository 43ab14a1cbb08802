"""ngram-map-k and ngram-map-k4v: what followed the key's earlier occurrences, learnt per key.

After llama.cpp's common/ngram-map.cpp; the shared rules of all lookup drafters (no match
at position 0, drafts copied from `tokens[:-1]`) are in ngram.py. Where these differ from
llama.cpp (on purpose):
- the match is the latest eligible occurrence, as llama.cpp's linear search finds it; its
  optional hash index (2**18 buckets) returns the first indexed one and loses collisions;
- k4v counts each occurrence once (llama.cpp recounts the previous match each time the key
  drafts) and drafts the dominant m-gram (llama.cpp copies what follows the latest match,
  even when that is not the m-gram it counted);
- map-k honours min_hits as llama.cpp's docs say (its code skips it; same at the default 1);
- begin() starts a new sequence, so a slot's map is rebuilt (llama.cpp keeps it and prunes
  what lies past a shortened prompt, because its slots continue conversations).

Each drafter is a pure function (a readable reference with a worked example) and a
`Speculator` whose per-slot state grows with the context (`_MapSlot`), so a step costs the
tokens added since the last step, not the whole context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from specserve.speculative.base import Draft, DraftRequest, Speculator, slot_state
from specserve.speculative.ngram import TokenArray, check_positive

# most distinct m-grams ngram-map-k4v keeps per key [llama.cpp: COMMON_NGRAM_MAX_VALUES]
MAX_VALUES = 4
# ngram-map-k4v drafts the most frequent m-gram only if it is seen at least this many times as
# often as all the others together (llama.cpp: `max_occur < 2 * sum_occur` means no draft)
DOMINANCE = 2
# new key starts indexed one by one up to this many; more go through numpy's sliding window
FEW = 16


# pure references --------------------------------------------------------------------------


def _latest_match(tokens: Sequence[int], n: int, m: int) -> int:
    """Latest start j in [1, L-n-m-2] of the last n tokens, so that m tokens follow; else -1."""
    length = len(tokens)
    if length < 2 * n + m + 1:  # llama.cpp: len(inp) < 2n + m means no draft
        return -1
    key = list(tokens[length - n :])
    for j in range(length - n - m - 2, 0, -1):
        if list(tokens[j : j + n]) == key:
            return j
    return -1


def ngram_map_k_draft(
    tokens: Sequence[int], n: int = 12, m: int = 48, n_cap: int | None = None
) -> list[int]:
    """Reference for `ngram-map-k`: the min(m, n_cap) tokens after the latest earlier key.

    The key is the last n tokens; it matches an earlier occurrence that starts at position
    1 .. L-n-m-2 (so a whole m-gram follows it inside `tokens[:-1]`); no draft unless
    `L >= 2n + m + 1`. `n_cap` is what `NgramMapK` learns per key: the number of tokens
    accepted the last time the key drafted (None: no cap yet).

    tokens: [L] context, newest token last. Returns the draft (possibly empty).

    Example (n=2, m=2): the key [5, 6] occurred at position 1 and at 4; the latest wins.

    >>> ngram_map_k_draft([0, 5, 6, 1, 5, 6, 2, 3, 9, 5, 6], n=2, m=2)
    [2, 3]
    >>> ngram_map_k_draft([0, 5, 6, 1, 5, 6, 2, 3, 9, 5, 6], n=2, m=2, n_cap=1)
    [2]
    """
    j = _latest_match(tokens, n, m)
    if j < 0:
        return []
    n_draft = m if n_cap is None else min(m, n_cap)
    return list(tokens[j + n : j + n + n_draft])


def ngram_map_k4v_draft(
    tokens: Sequence[int], n: int = 12, m: int = 48, n_cap: int | None = None
) -> list[int]:
    """Reference for `ngram-map-k4v`: draft the key's m-gram that clearly dominates.

    Matching is as in `ngram_map_k_draft`. Then every occurrence of the key that starts at
    0 .. match counts the m-gram after it; only the first 4 distinct m-grams are kept. The
    most frequent one (first on ties) is drafted, capped at n_cap, unless the others
    together are seen more than half as often (llama.cpp: `max < 2 * sum(others)`).

    tokens: [L] context, newest token last. Returns the draft (possibly empty).

    Example (n=1, m=2): after key 7 came [1, 2] once and [3, 4] once: 1 < 2 * 1, no draft;
    one more [1, 2] makes it 2 >= 2 * 1, and [1, 2] is drafted even where the latest
    occurrence was followed by [3, 4] (llama.cpp would copy [3, 4] there).

    >>> ngram_map_k4v_draft([7, 1, 2, 7, 3, 4, 0, 7], n=1, m=2)
    []
    >>> ngram_map_k4v_draft([7, 1, 2, 7, 3, 4, 7, 1, 2, 0, 7], n=1, m=2)
    [1, 2]
    >>> ngram_map_k4v_draft([7, 1, 2, 7, 1, 2, 7, 3, 4, 0, 7], n=1, m=2)
    [1, 2]
    """
    j = _latest_match(tokens, n, m)
    if j < 0:
        return []
    key = list(tokens[len(tokens) - n :])
    counts: dict[tuple[int, ...], int] = {}  # insertion order = order of first occurrence
    for i in range(j + 1):
        value = tuple(tokens[i + n : i + n + m])
        if list(tokens[i : i + n]) == key and (value in counts or len(counts) < MAX_VALUES):
            counts[value] = counts.get(value, 0) + 1
    best = max(counts, key=counts.__getitem__)  # the first of equals, as llama.cpp
    if counts[best] < DOMINANCE * (sum(counts.values()) - counts[best]):
        return []
    return list(best[: m if n_cap is None else min(m, n_cap)])


# incremental speculators ------------------------------------------------------------------


@dataclass
class _Value:
    """An m-gram seen after a key [common_ngram_map_value]."""

    start: int  # where (one copy of) the m-gram starts in the context
    n_accepted: int  # accepted tokens the last time it was drafted; caps the next draft
    count: int = 0  # occurrences after the key, each counted once


@dataclass
class _Key:
    """Statistics of a key that has been drafted from [common_ngram_map_key]."""

    hits: int = 0  # draft-time look-ups that found the key [key_num]
    counted_to: int = -1  # occurrences starting <= this are counted in `values` [stat_idx]
    values: list[_Value] = field(default_factory=list)


class _MapSlot:
    """One slot's context, its index of key n-grams, and the statistics of drafted keys.

    The index holds the starts j <= L-n-m-2 (those with a whole m-gram after them): `latest`
    maps a key (its tokens' bytes) to its latest start, and `prev[j]` is the start before
    j of the same key (-1 if none), so all occurrences are a walk back from `latest`. Keys
    are bytes and starts ints, objects the garbage collector does not track: indexing a
    long prompt creates no per-key containers for it to trace.
    """

    def __init__(self, n: int, m: int) -> None:
        self.n, self.m = n, m
        self.context = TokenArray()
        self.clear_index()

    def clear_index(self) -> None:
        self.latest: dict[bytes, int] = {}
        self.prev: list[int] = []  # starts [0, len(prev)) are indexed
        self.keys: dict[bytes, _Key] = {}
        self.last: tuple[_Key, int] | None = None  # (key, value slot) of the last draft

    def sync(self, tokens: Sequence[int]) -> None:
        """Take in the new tokens; index the starts that now have a whole m-gram after them."""
        if not self.context.sync(tokens):
            self.clear_index()  # not a continuation of what we saw: a new sequence
        arr, first, n = self.context.view, len(self.prev), self.n
        stop = len(arr) - n - self.m - 1
        if stop <= first:
            return
        if stop - first <= FEW:  # a decode step's token or few: numpy's window costs more
            keys = [arr[j : j + n].tobytes() for j in range(first, stop)]
        else:
            windows = np.lib.stride_tricks.sliding_window_view(arr[first : stop + n - 1], n)
            rows = np.ascontiguousarray(windows).view(np.dtype((np.void, 8 * n)))  # [k, 1]
            # each row's 8n bytes, equal to arr[j:j+n].tobytes() (unstructured void -> bytes)
            keys = cast("list[bytes]", rows.ravel().tolist())
        for j, key in enumerate(keys, start=first):
            self.prev.append(self.latest.get(key, -1))
            self.latest[key] = j

    def match(self) -> tuple[bytes, int]:
        """The key (last n tokens) and its latest eligible start >= 1, or -1."""
        arr = self.context.view
        key = arr[len(arr) - self.n :].tobytes()
        if len(arr) < 2 * self.n + self.m + 1:
            return key, -1
        j = self.latest.get(key, -1)
        return key, (j if j >= 1 else -1)

    def count_values(self, stats: _Key, match: int) -> None:
        """Count the m-grams after the key's occurrences in (counted_to, match], in order."""
        new = []
        j = match
        while j > stats.counted_to:
            new.append(j)
            j = self.prev[j]
        arr, n, m = self.context.view, self.n, self.m
        for i in reversed(new):
            value = arr[i + n : i + n + m]
            seen = next(
                (v for v in stats.values if (arr[v.start : v.start + m] == value).all()), None
            )
            if seen is None and len(stats.values) < MAX_VALUES:
                seen = _Value(start=i + n, n_accepted=m)
                stats.values.append(seen)
            if seen is not None:
                seen.count += 1
        stats.counted_to = match

    def tokens(self, start: int, count: int) -> list[int]:
        return self.context.view[start : start + count].tolist()


class _NgramMap(Speculator):
    """Shared machinery of ngram-map-k and ngram-map-k4v: per-slot `_MapSlot`s, feedback."""

    def __init__(self, n: int = 12, m: int = 48, min_hits: int = 1) -> None:
        super().__init__()
        check_positive(n=n, m=m, min_hits=min_hits)
        self.n, self.m, self.min_hits = n, m, min_hits
        self._slots: dict[int, _MapSlot] = {}

    def _begin(self, slot: int, prompt: Sequence[int]) -> None:
        super()._begin(slot, prompt)
        self._slots[slot] = _MapSlot(self.n, self.m)
        self._slots[slot].sync(prompt)  # index the prompt now, not in the first step

    def _reset(self, slot: int) -> None:
        super()._reset(slot)
        self._slots.pop(slot, None)

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for req in requests:
            state = slot_state(self._slots, req.slot, lambda: _MapSlot(self.n, self.m))
            state.sync(req.tokens)
            state.last = None
            drafts.append(Draft(self._draft_slot(state)))
        return drafts

    def _draft_slot(self, state: _MapSlot) -> list[int]:
        raise NotImplementedError

    def _accept(self, slot: int, n_accepted: int, n_proposed: int) -> None:
        state = self._slots.get(slot)
        if state is not None and state.last is not None:
            stats, i = state.last
            stats.values[i].n_accepted = n_accepted  # the next draft of this value is capped


class NgramMapK(_NgramMap):
    """`ngram-map-k`: draft what followed the key's latest occurrence, capped per key.

    As `ngram_map_k_draft`, plus what llama.cpp learns per key and slot: a draft is at most
    as long as the number of tokens accepted the last time this key drafted (m at first; so
    a key whose draft was wholly rejected never drafts again in that sequence).

    n: key length [--spec-ngram-size-n, 12]; m: most tokens drafted [--spec-ngram-size-m, 48];
    min_hits: draft-time look-ups of a key needed before it drafts [--spec-ngram-min-hits, 1].
    """

    name = "ngram-map-k"

    def _draft_slot(self, state: _MapSlot) -> list[int]:
        key, match = state.match()
        if match < 0:
            return []
        stats = state.keys.get(key)
        if stats is None:  # value 0 only holds the acceptance cap in this mode
            stats = state.keys[key] = _Key(values=[_Value(start=match + self.n, n_accepted=self.m)])
        stats.hits += 1
        if stats.hits < self.min_hits:
            return []
        state.last = (stats, 0)
        n_draft = min(self.m, stats.values[0].n_accepted)
        return state.tokens(match + self.n, n_draft)


class NgramMapK4V(_NgramMap):
    """`ngram-map-k4v`: up to 4 m-grams per key; draft the dominant one, capped per value.

    As `ngram_map_k4v_draft`, plus llama.cpp's per-slot learning: a key drafts only from its
    `min_hits`-th draft-time look-up on, and each m-gram's draft is capped by the tokens
    accepted the last time it was drafted (m at first).

    n: key length [12]; m: m-gram length and most tokens drafted [48]; min_hits [1]. (llama.cpp
    suggests n=8, m=8, min_hits=2 when the text has many long repetitions.)
    """

    name = "ngram-map-k4v"

    def _draft_slot(self, state: _MapSlot) -> list[int]:
        key, match = state.match()
        if match < 0:
            return []
        stats = state.keys.setdefault(key, _Key())
        stats.hits += 1
        if stats.hits < self.min_hits:
            return []
        state.count_values(stats, match)
        counts = [v.count for v in stats.values]
        best = counts.index(max(counts))
        if counts[best] < DOMINANCE * (sum(counts) - counts[best]):
            return []
        state.last = (stats, best)
        value = stats.values[best]
        return state.tokens(value.start, min(self.m, value.n_accepted))
