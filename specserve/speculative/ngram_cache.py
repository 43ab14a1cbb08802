"""ngram-cache: draft from n-gram statistics of the context, of past requests, and of a corpus.

After llama.cpp's common/ngram-cache.{h,cpp}, as its `lookup` example and the `ngram-cache`
speculator of common/speculative.cpp use it. An *n-gram cache* maps each n-gram (n = 1..4)
to how often each token followed it. There are three:

- context: the slot's own context (prompt + emitted tokens), updated every step;
- dynamic: what earlier requests saw: a slot's context cache is merged into it when the slot
  is reset (llama.cpp's `lookup` merges at the end of a generation). Shared by all slots;
- static: bigram statistics of a large corpus (optional), to validate and as last resort.

A draft grows one token at a time, from the context + draft so far, until n_max tokens or a
miss. Each token comes from the first of these that yields one:
1. the context cache, longest n-gram first, passing the *lax* thresholds;
2. the dynamic cache, longest n-gram first, passing the *strict* thresholds;
3. the static cache alone (the last bigram), passing the lax thresholds for n = 2.
In 1 and 2 the static cache validates: a candidate's count is weighted by 100 x its count
after the last bigram in the corpus (x 1 when the corpus never saw it there), and the most
weighted candidate must then pass the thresholds on its own count: at least `min sample`
observations of the n-gram and at least `min percent` of them followed by the candidate.

Differences from llama.cpp (with ngram_min = 1, as llama.cpp always has, only the first and
the last two can change a draft):
- among equally weighted candidates the one seen first wins (llama.cpp: hash-map order);
- thresholds are indexed by n-gram size (llama.cpp: by position in its n-gram list);
- n-grams longer than context + draft are skipped (llama.cpp reads before its buffer);
- the context cache sees the whole context when it adds the n-grams that end in new tokens,
  as `lookup` does (the speculator passes only the new tokens and so misses the n-grams that
  straddle two steps);
- the dynamic cache is learned in-process and bounded (`max_dynamic_ngrams`: the n-grams
  learned first are dropped); llama.cpp's speculator only loads it from a file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import islice

import numpy as np

from specserve.speculative.base import Draft, DraftRequest, Speculator
from specserve.speculative.ngram import check_positive
from specserve.speculative.tenants import PerTenant

# n-gram -> {next token: times seen}; dicts keep insertion order, which breaks ties
NgramCounts = dict[tuple[int, ...], dict[int, int]]

NGRAM_MAX = 4  # longest n-gram the thresholds cover [llama.cpp: LLAMA_NGRAM_MAX]
NGRAM_STATIC = 2  # n-gram size of the static cache [llama.cpp: LLAMA_NGRAM_STATIC]
STATIC_WEIGHT = 100  # a candidate the corpus saw after the last bigram weighs 100 x that count

# thresholds by n-gram size 1..4 [llama.cpp: draft_min_{sample_size,percent}_{lax,strict}]
MIN_SAMPLE_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLE_STRICT = (4, 3, 2, 2)
MIN_PERCENT_STRICT = (75, 66, 66, 66)


def ngram_cache_update(
    cache: NgramCounts, tokens: Sequence[int], ngram_min: int, ngram_max: int, n_new: int
) -> None:
    """Count, for n in [ngram_min, ngram_max], each n-gram that ends just before a new token.

    tokens: [L] the whole sequence; its last n_new tokens are new since the previous update.
    For each new position i, `tokens[i-n:i]` -> `tokens[i]` is counted (when i >= n), so a
    sequence that only grows, updated step by step, ends with the counts of one update.

    Example: 1- and 2-grams of [1, 2, 1, 3].

    >>> cache = {}
    >>> ngram_cache_update(cache, [1, 2, 1, 3], ngram_min=1, ngram_max=2, n_new=4)
    >>> cache
    {(1,): {2: 1, 3: 1}, (2,): {1: 1}, (1, 2): {1: 1}, (2, 1): {3: 1}}
    """
    length = len(tokens)
    for n in range(ngram_min, ngram_max + 1):
        for i in range(max(length - n_new, n), length):
            followers = cache.setdefault(tuple(tokens[i - n : i]), {})
            token = tokens[i]
            followers[token] = followers.get(token, 0) + 1


def ngram_cache_merge(target: NgramCounts, other: NgramCounts) -> None:
    """Add `other`'s counts into `target` [llama.cpp: common_ngram_cache_merge]."""
    for ngram, followers in other.items():
        merged = target.setdefault(ngram, {})
        for token, count in followers.items():
            merged[token] = merged.get(token, 0) + count


def build_static_cache(tokens: Sequence[int]) -> NgramCounts:
    """The static cache of a corpus: its bigrams and their followers [llama-lookup-create]."""
    cache: NgramCounts = {}
    ngram_cache_update(cache, tokens, NGRAM_STATIC, NGRAM_STATIC, len(tokens))
    return cache


def load_token_file(path: str | os.PathLike[str]) -> list[int]:
    """Token ids from a `.npy` array, or from a text file of whitespace-separated integers."""
    if os.fspath(path).endswith(".npy"):
        return [int(t) for t in np.load(path).reshape(-1)]
    with open(path) as f:
        return [int(t) for t in f.read().split()]


def _try_primary(
    cache: NgramCounts,
    seq: list[int],
    static_followers: dict[int, int],
    ngram_min: int,
    ngram_max: int,
    min_sample: Sequence[int],
    min_percent: Sequence[int],
) -> int | None:
    """The next token by the context or dynamic cache, longest n-gram first; None if none passes."""
    for n in range(min(ngram_max, len(seq)), ngram_min - 1, -1):
        followers = cache.get(tuple(seq[len(seq) - n :]))
        if followers is None:
            continue
        best, best_count, best_weight, total = None, 0, 0, 0
        for token, count in followers.items():
            in_corpus = static_followers.get(token, 0)
            weight = count * (STATIC_WEIGHT * in_corpus if in_corpus else 1)
            if weight > best_weight:  # strict: the first seen wins ties
                best, best_count, best_weight = token, count, weight
            total += count
        if total < min_sample[n - 1] or 100 * best_count < min_percent[n - 1] * total:
            continue
        return best
    return None


def _try_static(static_followers: dict[int, int]) -> int | None:
    """The next token by the corpus alone, if it passes the lax bigram thresholds."""
    if not static_followers:
        return None
    total = sum(static_followers.values())
    best = max(static_followers, key=static_followers.__getitem__)  # first of equals
    top = static_followers[best]
    n = NGRAM_STATIC
    if total < MIN_SAMPLE_LAX[n - 1] or 100 * top < MIN_PERCENT_LAX[n - 1] * total:
        return None
    return best


def ngram_cache_draft(
    tokens: Sequence[int],
    n_draft: int,
    context: NgramCounts,
    dynamic: NgramCounts,
    static: NgramCounts,
    ngram_min: int = 1,
    ngram_max: int = NGRAM_MAX,
) -> list[int]:
    """Draft up to n_draft tokens: context cache, then dynamic, then static (module docstring).

    tokens: [L] context, newest token last (llama.cpp's `inp`); no draft when L < 2.
    context / dynamic: caches of n-grams of sizes ngram_min..ngram_max; static: of bigrams.

    Example: after 5 the context saw 6 twice and 7 once (2/3 >= 66%: 6 passes the lax 1-gram
    thresholds), and then continues with 5 and 6. A corpus that saw only 7 after the bigram
    (8, 5) makes 7 the candidate, which fails on its own count (1/3 < 66%); the corpus then
    drafts 7 alone, and nothing follows (5, 7) often enough anywhere.

    >>> tokens = [5, 6, 5, 6, 5, 7, 8, 5]
    >>> context = {}
    >>> ngram_cache_update(context, tokens, 1, 4, len(tokens))
    >>> ngram_cache_draft(tokens, 3, context, {}, {})
    [6, 5, 6]
    >>> ngram_cache_draft(tokens, 3, context, {}, build_static_cache([8, 5, 7, 8, 5, 7]))
    [7]
    """
    if len(tokens) < NGRAM_STATIC:
        return []
    # only the last ngram_max tokens are ever looked at: copy those, not the context
    seq = [int(t) for t in tokens[max(0, len(tokens) - max(ngram_max, NGRAM_STATIC)) :]]
    draft: list[int] = []
    while len(draft) < n_draft:
        static_followers = static.get(tuple(seq[len(seq) - NGRAM_STATIC :]), {})
        token = _try_primary(
            context, seq, static_followers, ngram_min, ngram_max, MIN_SAMPLE_LAX, MIN_PERCENT_LAX
        )
        if token is None:
            token = _try_primary(
                dynamic,
                seq,
                static_followers,
                ngram_min,
                ngram_max,
                MIN_SAMPLE_STRICT,
                MIN_PERCENT_STRICT,
            )
        if token is None:
            token = _try_static(static_followers)
        if token is None:
            break
        draft.append(token)
        seq.append(token)
    return draft


class _SlotCache:
    """A slot's context and its context cache, brought up to date with new tokens only."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        self.cache: NgramCounts = {}

    def extends(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` continue this context.

        Only the last old token is compared: cheap, and enough to catch a slot that starts a
        new sequence without begin(); the engine's contract is that contexts only grow.
        """
        n_old = len(self.tokens)
        return len(tokens) >= n_old and (n_old == 0 or tokens[n_old - 1] == self.tokens[-1])

    def sync(self, tokens: Sequence[int]) -> None:
        """Become `tokens` (which extend the context): count the n-grams ending in new tokens."""
        n_old = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens[n_old:])
        n_new = len(self.tokens) - n_old
        ngram_cache_update(self.cache, self.tokens, self.ngram_min, self.ngram_max, n_new)


class NgramCacheSpeculator(Speculator):
    """`ngram-cache`: `ngram_cache_draft` with a context cache per slot and shared dynamic cache.

    n_max: most tokens drafted [llama.cpp: --draft-max 16 in `lookup`; 8 in the speculator];
    ngram_min / ngram_max: n-gram sizes of the context and dynamic caches [1, 4];
    static_tokens / static_path: a corpus (token ids, or a file of them: `load_token_file`)
        whose bigrams make the static cache [--lookup-cache-static]; none by default;
    max_dynamic_ngrams: most n-grams the dynamic cache keeps; the earliest learned go first
        [256 Ki: about 75 MB, some 300 B an n-gram].
    """

    name = "ngram-cache"

    def __init__(
        self,
        n_max: int = 16,
        ngram_min: int = 1,
        ngram_max: int = NGRAM_MAX,
        static_tokens: Sequence[int] | None = None,
        static_path: str | os.PathLike[str] | None = None,
        max_dynamic_ngrams: int = 1 << 18,
    ) -> None:
        super().__init__()
        check_positive(n_max=n_max, ngram_min=ngram_min, ngram_max=ngram_max)
        check_positive(max_dynamic_ngrams=max_dynamic_ngrams)
        if not ngram_min <= ngram_max <= NGRAM_MAX:
            raise ValueError(
                f"need ngram_min <= ngram_max <= {NGRAM_MAX}: {ngram_min}, {ngram_max}"
            )
        if static_tokens is not None and static_path is not None:
            raise ValueError("give static_tokens or static_path, not both")
        self.n_max, self.ngram_min, self.ngram_max = n_max, ngram_min, ngram_max
        self.max_dynamic_ngrams = max_dynamic_ngrams
        if static_path is not None:
            static_tokens = load_token_file(static_path)
        self.static: NgramCounts = build_static_cache(static_tokens or [])
        self._dynamic: PerTenant[NgramCounts] = PerTenant(dict)  # kept apart per tenant
        self._slots: dict[int, _SlotCache] = {}

    @property
    def dynamic(self) -> NgramCounts:
        """The default tenant's dynamic cache."""
        return self._dynamic[None]

    def _begin(self, slot: int, prompt: Sequence[int]) -> None:
        self._learn(slot)  # a slot reused without reset() finished its previous sequence
        state = self._slots[slot] = _SlotCache(self.ngram_min, self.ngram_max)
        state.sync(prompt)  # count the prompt now, not in the first step

    def _reset(self, slot: int) -> None:
        self._learn(slot)

    def _learn(self, slot: int) -> None:
        """Merge a finished slot's context cache into the dynamic cache; forget the slot."""
        state = self._slots.pop(slot, None)
        if state is None:
            return
        dynamic = self._dynamic[self.tenant(slot)]
        ngram_cache_merge(dynamic, state.cache)
        excess = len(dynamic) - self.max_dynamic_ngrams
        if excess > 0:  # dicts iterate in insertion order: the earliest learned come first
            for ngram in list(islice(dynamic, excess)):
                del dynamic[ngram]

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for req in requests:
            state = self._slots.get(req.slot)
            if state is None or not state.extends(req.tokens):
                self._learn(req.slot)  # a new sequence without begin(): the old one finished
                state = self._slots[req.slot] = _SlotCache(self.ngram_min, self.ngram_max)
            state.sync(req.tokens)
            tokens = ngram_cache_draft(
                state.tokens,
                min(self.n_max, req.n_max),
                state.cache,
                self._dynamic[self.tenant(req.slot)],
                self.static,
                self.ngram_min,
                self.ngram_max,
            )
            drafts.append(Draft(tokens))
        return drafts
