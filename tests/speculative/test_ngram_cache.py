"""ngram-cache: worked examples, llama.cpp's loop transliterated, the speculator across requests."""

from __future__ import annotations

import doctest
import random
from collections.abc import Sequence
from functools import partial

import numpy as np
import pytest

from specserve.speculative import ngram_cache
from specserve.speculative.base import DraftRequest
from specserve.speculative.ngram_cache import (
    NgramCacheSpeculator,
    NgramCounts,
    build_static_cache,
    ngram_cache_draft,
    ngram_cache_merge,
    ngram_cache_update,
)
from tests.speculative import drive
from tests.speculative.drive import distinct_tokens, draft, random_tokens

generate = partial(drive.generate, n_max=16)  # these drafters' tests use 16


def counts(*seqs: Sequence[int], ngram_min: int = 1, ngram_max: int = 4) -> NgramCounts:
    cache: NgramCounts = {}
    for seq in seqs:
        ngram_cache_update(cache, seq, ngram_min, ngram_max, len(seq))
    return cache


def test_docstring_examples():
    result = doctest.testmod(ngram_cache)
    assert result.attempted > 0 and result.failed == 0


# pure functions -------------------------------------------------------------------------------


def test_update_step_by_step_equals_once():
    tokens = random_tokens(0, 300, 5)
    stepwise: NgramCounts = {}
    length = 0
    for n_new in [1, 7, 2, 50, 1, 239]:
        length += n_new
        ngram_cache_update(stepwise, tokens[:length], 1, 4, n_new)
    assert stepwise == counts(tokens)


def test_merge_adds_counts():
    target = counts([1, 2, 1], ngram_max=1)
    ngram_cache_merge(target, counts([1, 2, 1, 3], ngram_max=1))
    assert target == {(1,): {2: 2, 3: 1}, (2,): {1: 2}}


WORKED = [5, 6, 5, 6, 5, 7, 8, 5]
CASES = [  # id, context, finished requests (dynamic), static corpus, n_draft, expected
    ("worked-example", WORKED, [], [], 3, [6, 5, 6]),
    ("static-validates", WORKED, [], [8, 5, 7, 8, 5, 7], 3, [7]),
    ("too-short", [5], [], [], 3, []),
    ("lax-1gram-needs-two", [5, 6, 5], [], [], 3, []),
    ("lax-1gram-needs-66-percent", [5, 6, 5, 7, 5], [], [], 3, []),
    ("3gram-once-suffices", [1, 2, 3, 4, 9, 1, 2, 3], [], [], 4, [4, 9, 1, 2]),
    ("longest-ngram-first", [7, 1, 7, 1, 7, 1, 5, 2, 7, 3, 5, 2, 7], [], [], 1, [3]),
    ("dynamic-strict-needs-two", [1, 2, 3, 4], [[1, 2, 3, 4, 9]], [], 1, []),
    ("dynamic-seen-twice", [1, 2, 3, 4], [[1, 2, 3, 4, 9]] * 2, [], 1, [9]),
    ("context-before-dynamic", [1, 2, 3, 4, 8, 2, 3, 4], [[2, 3, 4, 9]] * 3, [], 1, [8]),
    ("static-alone", [8, 5], [], [8, 5, 7] * 2, 3, [7]),
    ("n-draft-caps", [1, 2] * 10, [], [], 5, [1, 2, 1, 2, 1]),
]


@pytest.mark.parametrize(
    "tokens, finished, corpus, n_draft, expected",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_draft_cases(tokens, finished, corpus, n_draft, expected):
    static = build_static_cache(corpus)
    result = ngram_cache_draft(tokens, n_draft, counts(tokens), counts(*finished), static)
    assert result == expected
    spec = NgramCacheSpeculator(static_tokens=corpus)
    for seq in finished:  # finished requests teach the dynamic cache
        spec.begin(9, seq)
        spec.reset(9)
    spec.begin(0, tokens)
    assert draft(spec, 0, tokens, n_max=n_draft) == expected


# llama.cpp's common_ngram_cache_draft, transliterated ---------------------------------------

NULL = -1  # LLAMA_TOKEN_NULL pads an n-gram to 4 tokens


def llama_key(tokens: Sequence[int]) -> tuple[int, ...]:
    return tuple(tokens) + (NULL,) * (4 - len(tokens))


def llama_update(cache: dict, inp: list[int], nnew: int, ngram_min: int, ngram_max: int) -> None:
    for ngram_size in range(ngram_min, ngram_max + 1):
        for i in range(max(len(inp) - nnew, ngram_size), len(inp)):
            part = cache.setdefault(llama_key(inp[i - ngram_size : i]), {})
            part[inp[i]] = part.get(inp[i], 0) + 1


def llama_try_draft(primary: dict, ngrams: list, part_static: dict, sample: tuple, percent: tuple):
    for i in range(len(ngrams) - 1, -1, -1):
        part = primary.get(ngrams[i])
        if part is None:
            continue
        max_primary = max_static = total = 0
        max_token = None
        for token, count_primary in part.items():  # llama.cpp: hash order; here insertion
            count_static = 100 * part_static[token] if token in part_static else 1
            if count_primary * count_static > max_primary * max_static:
                max_token, max_primary, max_static = token, count_primary, count_static
            total += count_primary
        if total < sample[i] or 100 * max_primary < percent[i] * total:
            continue
        return max_token
    return None


def llama_try_static(static: dict, ngram: tuple):
    part = static.get(ngram)
    if part is None:
        return None
    max_count, total, max_token = 0, 0, None
    for token, count in part.items():
        if count > max_count:
            max_token, max_count = token, count
        total += count
    return None if total < 2 or 100 * max_count < 50 * total else max_token


def llama_draft(inp: list[int], n_draft: int, context: dict, dynamic: dict, static: dict):
    draft = [inp[-1]]  # llama.cpp starts the draft with the last sampled token

    def get_token(i: int) -> int:
        return inp[i] if i < len(inp) else draft[1 + i - len(inp)]

    if len(inp) < 2:
        return []
    while len(draft) - 1 < n_draft:
        start = len(inp) - 2 + len(draft) - 1
        part_static = static.get(llama_key([get_token(j) for j in range(start, start + 2)]), {})
        ngrams = []
        for size in range(1, 5):
            start_cd = len(inp) - size + len(draft) - 1
            ngrams.append(llama_key([get_token(j) for j in range(start_cd, start_cd + size)]))
        token = llama_try_draft(context, ngrams, part_static, (2, 2, 1, 1), (66, 50, 50, 50))
        if token is None:
            token = llama_try_draft(dynamic, ngrams, part_static, (4, 3, 2, 2), (75, 66, 66, 66))
        if token is None:
            token = llama_try_static(static, llama_key([get_token(j) for j in (start, start + 1)]))
        if token is None:
            break
        draft.append(token)
    return draft[1:]


@pytest.mark.parametrize("seed", range(6))
def test_draft_matches_llama_loop(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 4, 6])
    finished = [random_tokens(rng.randrange(10**9), rng.randrange(1, 80), vocab) for _ in range(3)]
    corpus = random_tokens(rng.randrange(10**9), 300, vocab)
    dynamic, static = counts(*finished), build_static_cache(corpus)
    l_dynamic, l_static = {}, {}
    for seq in finished:
        llama_update(l_dynamic, seq, len(seq), 1, 4)
    llama_update(l_static, corpus, len(corpus), 2, 2)
    for _ in range(40):  # >= 4 tokens: llama.cpp reads before its buffer on shorter ones
        tokens = random_tokens(rng.randrange(10**9), rng.randrange(4, 60), vocab)
        l_context: dict = {}
        llama_update(l_context, tokens, len(tokens), 1, 4)
        n_draft = rng.choice([1, 4, 16])
        use_static = rng.random() < 0.5
        expected = llama_draft(
            tokens, n_draft, l_context, l_dynamic, l_static if use_static else {}
        )
        got = ngram_cache_draft(
            tokens, n_draft, counts(tokens), dynamic, static if use_static else {}
        )
        assert got == expected


# the speculator --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_speculator_equals_pure_function(seed):
    rng = random.Random(seed)
    spec = NgramCacheSpeculator(n_max=8, static_tokens=random_tokens(seed, 200, 4))
    finished: list[list[int]] = []
    for _ in range(3):
        tokens = random_tokens(rng.randrange(10**9), 120, 4)
        length = rng.randrange(1, 30)
        spec.begin(0, tokens[:length])
        while length <= len(tokens):
            context = tokens[:length]
            expected = ngram_cache_draft(
                context, 8, counts(context), counts(*finished), spec.static
            )
            assert draft(spec, 0, context) == expected
            seen, length = length, length + rng.randrange(1, 5)
        spec.reset(0)
        finished.append(tokens[:seen])  # the whole context (prompt too) is learned


def test_random_text_gives_empty_drafts():
    spec = NgramCacheSpeculator(static_tokens=distinct_tokens(1, 300))
    steps, accepted = generate(spec, distinct_tokens(2, 400), start=100)
    assert (steps, accepted) == (300, 0)
    assert spec.stats.drafts_generated == 0


@pytest.mark.parametrize("n_max, req_n_max, expected", [(16, 64, 16), (16, 5, 5), (64, 64, 64)])
def test_long_repetitive_context_drafts_long(n_max, req_n_max, expected):
    tokens = distinct_tokens(3, 50) * 100
    spec = NgramCacheSpeculator(n_max=n_max)
    spec.begin(0, tokens[:4000])
    for length in (4000, 4001, 4017, 5000):
        d = draft(spec, 0, tokens[:length], req_n_max)
        assert d == (tokens * 2)[length : length + expected]
        spec.accept(0, len(d))


def test_dynamic_cache_learns_across_requests():
    # strict thresholds: an n-gram must have been seen twice in finished requests to draft
    truth = distinct_tokens(4, 50) + distinct_tokens(5, 300)
    spec = NgramCacheSpeculator()
    runs = []
    for slot in (0, 1, 2):
        runs.append(generate(spec, truth, start=50, slot=slot))
        spec.reset(slot)
    assert runs[0] == runs[1] == (300, 0)
    assert runs[2][0] < 30 and runs[2][1] > 270, runs[2]


def test_slots_are_independent():
    texts = {slot: random_tokens(slot, 200, 4) for slot in (0, 1, 2)}
    shared = NgramCacheSpeculator()
    alone = {slot: NgramCacheSpeculator() for slot in texts}
    for slot, tokens in texts.items():
        shared.begin(slot, tokens[:20])
        alone[slot].begin(slot, tokens[:20])
    for length in range(20, 200, 7):  # interleaved steps
        requests = [DraftRequest(slot, tokens[:length], 8) for slot, tokens in texts.items()]
        together = [d.tokens for d in shared.draft(requests)]
        assert together == [alone[r.slot].draft([r])[0].tokens for r in requests]


def test_reset_and_begin():
    spec = NgramCacheSpeculator()
    old = [1, 2, 3, 4, 9]
    spec.begin(0, old)
    assert draft(spec, 0, old + [1, 2, 3], n_max=8) == [4, 9, 1, 2, 3, 4, 9, 1]
    spec.begin(0, [1, 2, 3, 4])  # reused without reset: the old context is learned, then gone
    assert spec.dynamic[(1, 2, 3)] == {4: 1}
    assert draft(spec, 0, [1, 2, 3, 4]) == []  # (1, 2, 3, 4) -> 9 seen once: strict needs 2
    spec.reset(0)
    assert spec.dynamic[(1, 2, 3)] == {4: 2}
    assert draft(spec, 5, [7, 1, 2, 3]) == [4]  # no begin(): drafts from the dynamic cache
    assert draft(spec, 5, [8]) == []  # a new sequence without begin(): the old one is learned
    assert spec.dynamic[(7, 1, 2)] == {3: 1}


def test_n_max_and_n_min_respected():
    tokens = [1, 2, 3, 4] * 20
    spec = NgramCacheSpeculator(n_max=16)
    spec.begin(0, tokens)
    for n_max in (1, 3, 16, 100):
        assert len(spec.draft([DraftRequest(0, tokens, n_max)])[0]) == min(n_max, 16)
    assert spec.draft([DraftRequest(0, tokens, 4, n_min=5)])[0].tokens == []


def test_stats_counted_by_base_class():
    spec = NgramCacheSpeculator()
    steps, accepted = generate(spec, distinct_tokens(7, 30) * 6, start=30)
    stats = spec.stats
    assert stats.tokens_accepted == accepted > 100
    assert stats.drafts_accepted <= stats.drafts_generated <= steps
    assert sum(stats.accept_len_hist) == stats.drafts_generated
    assert stats.proposed_per_pos[0] == stats.drafts_generated
    assert stats.draft_seconds > 0


@pytest.mark.parametrize("suffix", [".npy", ".txt"])
def test_static_cache_from_file(tmp_path, suffix):
    corpus = random_tokens(8, 500, 7)
    path = tmp_path / f"corpus{suffix}"
    if suffix == ".npy":
        np.save(path, np.array(corpus, dtype=np.int32))
    else:
        path.write_text(" ".join(map(str, corpus)) + "\n")
    assert NgramCacheSpeculator(static_path=path).static == build_static_cache(corpus)
    assert (
        NgramCacheSpeculator(static_path=str(path)).static
        == NgramCacheSpeculator(static_tokens=corpus).static
    )


def test_dynamic_cache_is_bounded():
    spec = NgramCacheSpeculator(max_dynamic_ngrams=10)
    spec.begin(0, list(range(100)))
    spec.reset(0)
    assert len(spec.dynamic) == 10
    assert list(spec.dynamic) == [tuple(range(i, i + 4)) for i in range(86, 96)]  # latest


@pytest.mark.parametrize(
    "params",
    [
        {"n_max": 0},
        {"ngram_min": 0},
        {"ngram_max": 5},
        {"ngram_min": 3, "ngram_max": 2},
        {"max_dynamic_ngrams": 0},
        {"static_tokens": [1, 2], "static_path": "x.npy"},
    ],
    ids=["n-max-0", "ngram-min-0", "ngram-max-5", "min-above-max", "no-dynamic", "two-statics"],
)
def test_invalid_parameters(params):
    with pytest.raises(ValueError):
        NgramCacheSpeculator(**params)
