"""Drafting by looking the context up in itself: the shared rules, and ngram-simple.

After llama.cpp's common/speculative.cpp and common/ngram-map.cpp: ngram-map-k and
ngram-map-k4v are in ngram_map.py, ngram-mod in ngram_mod.py. Every drafter sees a slot's
whole context `tokens` (prompt + emitted tokens; the last one is the newest token, which
the target has not consumed yet) and proposes what followed an earlier occurrence of the
context's last n tokens (the *key*). Names follow llama.cpp: with `L = len(tokens)`,
llama.cpp's `inp` is `tokens[:-1]` and its `sampled` is `tokens[-1]`.

Shared rules, all taken from llama.cpp so that drafts match its drafts:
- an occurrence starting at position 0 is never a match (llama.cpp uses 0 as "no match");
- drafted tokens are copied from `tokens[:-1]`, never past it.

Each drafter is a pure function (a readable reference with a worked example) and a
`Speculator`. ngram-simple, as llama.cpp's, scans the context once per step, vectorised
with numpy; its only per-slot state is the context as an array (`TokenArray`), so a step
converts the new tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specserve.speculative.base import Draft, DraftRequest, Speculator, slot_state


def check_positive(**params: int) -> None:
    """Raise ValueError naming the first parameter that is not an int >= 1."""
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# ngram-simple -----------------------------------------------------------------------------


def ngram_simple_draft(tokens: Sequence[int] | np.ndarray, n: int = 12, m: int = 48) -> list[int]:
    """Copy what followed the most recent earlier occurrence of the last n tokens.

    llama.cpp's `common_ngram_simple_draft`, rule for rule. With `L = len(tokens)`:
    - no draft unless `L - 1 > n + m + 1`;
    - the pattern is `tokens[L-n:]`; occurrences may start at 1 .. L-n-2 (position 0 and
      the occurrence one step before the pattern are never used); the latest one wins;
    - the draft is the up to m tokens after it, taken from `tokens[:-1]`; a draft shorter
      than n tokens is dropped.

    tokens: [L] context, newest token last. Returns the draft (possibly empty).

    Example (n=2, m=3): the pattern [2, 3] occurred at position 1, followed by 4, 5, 6.

    >>> ngram_simple_draft([1, 2, 3, 4, 5, 6, 7, 9, 2, 3], n=2, m=3)
    [4, 5, 6]
    >>> ngram_simple_draft([1, 2, 3, 4, 5, 2, 3], n=2, m=3)  # too short: L - 1 <= n + m + 1
    []
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    cur_len = length - 1  # llama.cpp's len(inp): the newest token is not in its history
    if cur_len <= n + m + 1:
        return []
    pattern = arr[length - n :]
    last_start = cur_len - n - 1
    # candidates by first token, verified newest first in chunks: typically one chunk
    starts = np.flatnonzero(arr[1 : last_start + 1] == pattern[0]) + 1
    windows = np.lib.stride_tricks.sliding_window_view(arr[: last_start + n], n)
    match = -1
    for hi in range(len(starts), 0, -256):
        chunk = starts[max(hi - 256, 0) : hi]
        hits = chunk[(windows[chunk] == pattern).all(axis=1)]
        if len(hits):
            match = int(hits[-1])
            break
    if match < 0:
        return []
    n_copy = min(m, cur_len - (match + n))
    if n_copy < n:
        return []
    return arr[match + n : match + n + n_copy].tolist()


class TokenArray:
    """A slot's context as a numpy array, extended by the new tokens only at each step."""

    def __init__(self) -> None:
        self._buf = np.empty(1024, dtype=np.int64)
        self._len = 0

    @property
    def view(self) -> np.ndarray:
        """The context: [L] int64 (a view, valid until the next sync)."""
        return self._buf[: self._len]

    def sync(self, tokens: Sequence[int]) -> bool:
        """Become `tokens`; False if they do not extend the old context (then start over).

        Only the last old token is compared: cheap, and enough to catch a slot that starts
        a new sequence without begin(); the engine's contract is that contexts only grow.
        """
        n_old = self._len
        extends = len(tokens) >= n_old and (n_old == 0 or tokens[n_old - 1] == self._buf[n_old - 1])
        n_old = n_old if extends else 0
        if len(tokens) > len(self._buf):
            buf = np.empty(max(len(tokens), 2 * len(self._buf)), dtype=np.int64)
            buf[:n_old] = self._buf[:n_old]
            self._buf = buf
        self._buf[n_old : len(tokens)] = tokens[n_old:]
        self._len = len(tokens)
        return extends


class NgramSimple(Speculator):
    """`ngram-simple`: `ngram_simple_draft` on each slot's context (no learning).

    n: pattern length [--spec-ngram-size-n, 12]; m: most tokens drafted [--spec-ngram-size-m, 48].
    Per-slot state is only a numpy copy of the context, so a step converts new tokens only.
    """

    name = "ngram-simple"

    def __init__(self, n: int = 12, m: int = 48) -> None:
        super().__init__()
        check_positive(n=n, m=m)
        self.n, self.m = n, m
        self._contexts: dict[int, TokenArray] = {}

    def _begin(self, slot: int, prompt: Sequence[int]) -> None:
        self._contexts[slot] = TokenArray()
        self._contexts[slot].sync(prompt)

    def _reset(self, slot: int) -> None:
        self._contexts.pop(slot, None)

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for req in requests:
            context = slot_state(self._contexts, req.slot, TokenArray)
            context.sync(req.tokens)
            drafts.append(Draft(ngram_simple_draft(context.view, self.n, self.m)))
        return drafts
