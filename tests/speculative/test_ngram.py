"""n-gram drafters: worked examples, llama.cpp's edge rules, incremental == reference, slots."""

from __future__ import annotations

import doctest
import random
from collections.abc import Callable

import pytest

from specserve.speculative import ngram, ngram_map, ngram_mod
from specserve.speculative.base import DraftRequest, Speculator
from specserve.speculative.ngram import NgramSimple, ngram_simple_draft
from specserve.speculative.ngram_map import (
    NgramMapK,
    NgramMapK4V,
    ngram_map_k4v_draft,
    ngram_map_k_draft,
)
from specserve.speculative.ngram_mod import NgramMod
from tests.speculative.drive import draft, generate, random_tokens

SMALL_TABLE = 1 << 16


def periodic(block: int, length: int, seed: int = 0) -> list[int]:
    """A long repetitive context: one random block of `block` tokens repeated."""
    unit = random_tokens(seed, block, 50_000)
    return (unit * (length // block + 1))[:length]


@pytest.mark.parametrize(
    "module", [ngram, ngram_map, ngram_mod], ids=lambda m: m.__name__.split(".")[-1]
)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ngram-simple ------------------------------------------------------------------------------


def simple_reference(tokens: list[int], n: int, m: int) -> list[int]:
    """llama.cpp's common_ngram_simple_draft loop, transliterated (inp + sampled)."""
    inp, sampled = tokens[:-1], tokens[-1]
    cur_len = len(inp)
    if cur_len <= n + m + 1:
        return []
    pattern = inp[cur_len - n + 1 :] + [sampled]
    for j in range(cur_len - n - 1, 0, -1):
        if inp[j : j + n] == pattern:
            n_copy = min(m, cur_len - (j + n))
            return [] if n_copy < n else inp[j + n : j + n + n_copy]
    return []


SIMPLE_CASES = [
    ("worked-example", [1, 2, 3, 4, 5, 6, 7, 9, 2, 3], 2, 3, [4, 5, 6]),
    ("too-short", [1, 2, 3, 4, 5, 2, 3], 2, 3, []),
    ("no-earlier-occurrence", [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 4], 2, 3, []),
    ("occurrence-at-0-ignored", [2, 3, 4, 5, 6, 7, 8, 9, 2, 3], 2, 3, []),
    ("latest-occurrence-wins", [1, 2, 3, 4, 2, 3, 5, 6, 7, 0, 2, 3], 2, 3, [5, 6, 7]),
    ("copy-stops-before-newest", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 5, 6, 1, 2], 2, 5, [5, 6, 1]),
    ("copy-shorter-than-n-dropped", [7] * 12, 2, 3, []),
    ("period-2-too-short-for-n-3", [1, 2] * 10, 3, 3, []),
    ("period-5-drafts-period-minus-1", [1, 2, 3, 4, 5] * 4, 3, 8, [1, 2, 3, 4]),
]


@pytest.mark.parametrize(
    "tokens, n, m, expected", [c[1:] for c in SIMPLE_CASES], ids=[c[0] for c in SIMPLE_CASES]
)
def test_ngram_simple_cases(tokens, n, m, expected):
    assert ngram_simple_draft(tokens, n, m) == expected
    assert simple_reference(tokens, n, m) == expected


@pytest.mark.parametrize("seed", range(6))
def test_ngram_simple_matches_llama_loop(seed):
    rng = random.Random(seed)
    for _ in range(60):
        n, m = rng.choice([1, 2, 3]), rng.choice([1, 2, 5])
        tokens = random_tokens(rng.randrange(10**9), rng.randrange(1, 120), rng.choice([2, 3, 5]))
        assert ngram_simple_draft(tokens, n, m) == simple_reference(tokens, n, m)


def test_ngram_simple_many_candidates_long_context():
    # every position is a candidate by its first token; the match is far back (> 1 chunk)
    tokens = [1] * 3000 + [2, 3, 4, 5] + [1] * 2000 + [9, 1, 1, 2, 3, 4]
    assert ngram_simple_draft(tokens, n=4, m=6) == [5, 1, 1, 1, 1, 1]


# ngram-map-k / ngram-map-k4v references --------------------------------------------------

MAP_K_CASES = [
    ("worked-example", [0, 5, 6, 1, 5, 6, 2, 3, 9, 5, 6], 2, 2, None, [2, 3]),
    ("capped", [0, 5, 6, 1, 5, 6, 2, 3, 9, 5, 6], 2, 2, 1, [2]),
    ("cap-zero", [0, 5, 6, 1, 5, 6, 2, 3, 9, 5, 6], 2, 2, 0, []),
    ("too-short", [5, 6, 1, 2, 5, 6], 2, 2, None, []),
    # the occurrence at 4 has only [2] after it inside tokens[:-1]: not eligible, 1 is
    ("needs-whole-mgram", [0, 5, 6, 1, 5, 6, 2, 5, 6], 2, 2, None, [1, 5]),
    ("occurrence-at-0-ignored", [5, 6, 1, 2, 3, 4, 7, 8, 5, 6], 2, 2, None, []),
]


@pytest.mark.parametrize(
    "tokens, n, m, cap, expected", [c[1:] for c in MAP_K_CASES], ids=[c[0] for c in MAP_K_CASES]
)
def test_ngram_map_k_reference(tokens, n, m, cap, expected):
    assert ngram_map_k_draft(tokens, n, m, cap) == expected


K4V_CASES = [
    ("tie-no-draft", [7, 1, 2, 7, 3, 4, 0, 7], None, []),
    ("two-to-one-drafts", [7, 1, 2, 7, 3, 4, 7, 1, 2, 0, 7], None, [1, 2]),
    ("dominant-not-latest", [7, 1, 2, 7, 1, 2, 7, 3, 4, 0, 7], None, [1, 2]),
    ("single-value", [7, 1, 2, 7, 1, 2, 0, 7], None, [1, 2]),
    ("capped", [7, 1, 2, 7, 1, 2, 0, 7], 1, [1]),
    # 4 distinct values are kept; later new ones are ignored: [5, 5] x2 never counts
    ("fifth-value-ignored", [7, 1, 1, 7, 2, 2, 7, 3, 3, 7, 4, 4, 7, 5, 5, 7, 5, 5, 0, 7], None, []),
    ("first-of-equals", [7, 1, 1, 7, 1, 1, 7, 2, 2, 7, 2, 2, 0, 7], None, []),
]


@pytest.mark.parametrize(
    "tokens, cap, expected", [c[1:] for c in K4V_CASES], ids=[c[0] for c in K4V_CASES]
)
def test_ngram_map_k4v_reference(tokens, cap, expected):
    assert ngram_map_k4v_draft(tokens, n=1, m=2, n_cap=cap) == expected


def test_k4v_dominance_threshold():
    # 4 x [1, 2] against 2 others: 4 >= 2 * 2 drafts; 3 against 2 does not
    head = [7, 1, 2] * 3 + [7, 3, 4, 7, 5, 6]
    assert ngram_map_k4v_draft(head + [7, 1, 2, 0, 7], n=1, m=2) == [1, 2]
    assert ngram_map_k4v_draft(head + [7, 3, 4, 0, 7], n=1, m=2) == []


# incremental speculators == references -----------------------------------------------------

REFERENCES: list[tuple[str, Callable[[], Speculator], Callable[[list[int]], list[int]]]] = [
    ("ngram-simple", lambda: NgramSimple(n=2, m=3), lambda t: ngram_simple_draft(t, 2, 3)),
    ("ngram-map-k", lambda: NgramMapK(n=2, m=3), lambda t: ngram_map_k_draft(t, 2, 3)),
    ("ngram-map-k4v", lambda: NgramMapK4V(n=2, m=3), lambda t: ngram_map_k4v_draft(t, 2, 3)),
    ("ngram-map-k4v-n1", lambda: NgramMapK4V(n=1, m=2), lambda t: ngram_map_k4v_draft(t, 1, 2)),
]


@pytest.mark.parametrize(
    "make, reference", [r[1:] for r in REFERENCES], ids=[r[0] for r in REFERENCES]
)
@pytest.mark.parametrize("seed", range(4))
def test_incremental_equals_reference(make, reference, seed):
    # contexts grow by 1..4 tokens a step, as with accepted drafts; no accept() feedback
    rng = random.Random(seed)
    tokens = random_tokens(seed, 400, 4)
    spec = make()
    length = rng.randrange(1, 20)
    spec.begin(0, tokens[:length])
    while length < len(tokens):
        length += rng.randrange(1, 5)
        context = tokens[:length]
        assert draft(spec, 0, context) == reference(context), f"length {length}"


@pytest.mark.parametrize("make", [r[1] for r in REFERENCES], ids=[r[0] for r in REFERENCES])
def test_context_that_does_not_extend_rebuilds(make):
    # a slot reused without begin()/reset() must not draft from the old sequence's index
    spec, old, new = make(), random_tokens(1, 200, 3), random_tokens(2, 150, 3)
    draft(spec, 0, old)
    fresh = make()
    assert draft(spec, 0, new) == draft(fresh, 0, new)


# map-k / k4v learning from acceptance -------------------------------------------------------


def test_map_k_draft_capped_by_last_acceptance():
    spec = NgramMapK(n=2, m=4)
    ctx = [0, 5, 6, 1, 2, 3, 4, 8, 9, 7, 7, 5, 6]
    assert draft(spec, 0, ctx) == [1, 2, 3, 4]
    spec.accept(0, 2)
    assert draft(spec, 0, ctx + [1, 2, 8, 5, 6]) == [1, 2]  # same key: capped at 2
    spec.accept(0, 0)
    assert draft(spec, 0, ctx + [1, 2, 8, 5, 6, 1, 9, 5, 6]) == []  # as llama.cpp: key is dead
    assert draft(spec, 0, ctx + [1, 2, 8, 5, 6, 1, 9, 5, 6, 3, 1, 2]) == [8, 5, 6, 1]  # other key


def test_map_k_dropped_draft_teaches_nothing():
    spec = NgramMapK(n=2, m=4)
    ctx = [0, 5, 6, 1, 2, 3, 4, 8, 9, 7, 7, 5, 6]
    assert draft(spec, 0, ctx, n_min=5) == []  # dropped by the base class (n_min)
    spec.accept(0, 0)
    assert draft(spec, 0, ctx + [1, 2, 8, 5, 6]) == [1, 2, 3, 4]


def test_map_k_clipped_draft_caps_next_draft():
    spec = NgramMapK(n=2, m=4)
    ctx = [0, 5, 6, 1, 2, 3, 4, 8, 9, 7, 7, 5, 6]
    assert draft(spec, 0, ctx, n_max=3) == [1, 2, 3]
    spec.accept(0, 3)
    assert draft(spec, 0, ctx + [1, 2, 3, 4, 5, 6]) == [1, 2, 3]


def test_map_k4v_min_hits_counts_draft_time_lookups():
    ctx = [7, 1, 2, 7, 1, 2, 0, 7]
    spec = NgramMapK4V(n=1, m=2, min_hits=2)
    assert draft(spec, 0, ctx) == []  # first look-up of key 7
    assert draft(spec, 0, ctx + [1, 2, 7]) == [1, 2]  # second look-up


def test_map_k4v_cap_is_per_value():
    spec = NgramMapK4V(n=1, m=3)
    ctx = [7, 1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 3, 9, 9, 7]
    assert draft(spec, 0, ctx) == [1, 2, 3]
    spec.accept(0, 1)
    assert draft(spec, 0, ctx + [1, 5, 5, 7]) == [1]


# slots, begin/reset, n_max, statistics ------------------------------------------------------

SPECS: list[tuple[str, Callable[[], Speculator]]] = [
    ("ngram-simple", lambda: NgramSimple(n=2, m=3)),
    ("ngram-map-k", lambda: NgramMapK(n=2, m=3)),
    ("ngram-map-k4v", lambda: NgramMapK4V(n=2, m=3)),
    ("ngram-mod", lambda: NgramMod(n_match=2, n_min=1, n_max=3, table_size=SMALL_TABLE)),
]
SPEC_IDS = [s[0] for s in SPECS]
REPEATING = [0, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5, 6, 8, 1, 2]  # drafts [3, 4, 5] everywhere
OTHER = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]


@pytest.mark.parametrize("make", [s[1] for s in SPECS], ids=SPEC_IDS)
def test_repeating_context_drafts_continuation(make):
    spec = make()
    spec.begin(0, REPEATING[:-1])
    assert draft(spec, 0, REPEATING) == [3, 4, 5]


@pytest.mark.parametrize("make", [s[1] for s in SPECS], ids=SPEC_IDS)
def test_slots_are_independent(make):
    spec = make()
    spec.begin(0, REPEATING[:-1])
    spec.begin(1, OTHER[:-1])
    assert draft(spec, 1, OTHER) == []
    assert draft(spec, 0, REPEATING) == [3, 4, 5]
    spec.accept(1, 0)  # slot 1 proposed nothing: no feedback that could leak
    spec.accept(0, 3)
    assert draft(spec, 1, OTHER + [1, 2]) == ([3, 4, 5] if spec.name == "ngram-mod" else [])
    spec.reset(1)
    assert draft(spec, 0, REPEATING + [3, 4, 5, 6, 8, 1, 2]) == [3, 4, 5]


@pytest.mark.parametrize("make", [s[1] for s in SPECS], ids=SPEC_IDS)
def test_reset_and_begin_start_a_new_sequence(make):
    spec = make()
    spec.begin(0, REPEATING[:-1])
    assert draft(spec, 0, REPEATING) == [3, 4, 5]
    spec.accept(0, 0)
    spec.reset(0)
    spec.begin(0, OTHER[:-1])
    assert draft(spec, 0, OTHER) == []
    if spec.name != "ngram-mod":  # its table is shared by design and survives reset
        assert draft(spec, 0, OTHER + [1, 2]) == []
    spec.begin(0, REPEATING[:-1])  # begin() forgets what map-k learned from the rejection
    assert draft(spec, 0, REPEATING) == [3, 4, 5]


@pytest.mark.parametrize("make", [s[1] for s in SPECS], ids=SPEC_IDS)
def test_n_max_clips_and_statistics_are_counted(make):
    spec = make()
    spec.begin(0, REPEATING[:-1])
    spec.begin(1, OTHER[:-1])
    drafts = spec.draft([DraftRequest(0, REPEATING, n_max=2), DraftRequest(1, OTHER, n_max=2)])
    assert [d.tokens for d in drafts] == [[3, 4], []]
    spec.accept(0, 1)
    spec.accept(1, 0)
    stats = spec.stats
    assert (stats.drafts_generated, stats.tokens_generated) == (1, 2)
    assert (stats.drafts_accepted, stats.tokens_accepted) == (1, 1)
    assert stats.proposed_per_pos == [1, 1] and stats.accepted_per_pos == [1]
    assert stats.accept_len_hist == [0, 1] and stats.draft_seconds > 0


@pytest.mark.parametrize("make", [s[1] for s in SPECS], ids=SPEC_IDS)
def test_draft_without_begin(make):
    # 38 tokens: past ngram-mod's first chunk of 32, which is when it starts adding n-grams
    assert draft(make(), 3, [0] + [1, 2, 3, 4, 5, 6, 9] * 5 + [1, 2]) == [3, 4, 5]


# long contexts, defaults -------------------------------------------------------------------

# (name, factory, accepted fraction, steps): 48-token drafts need ~41 steps, 64-token ones ~31
LONG_SPECS: list[tuple[str, Callable[[], Speculator], float, int]] = [
    ("ngram-simple", NgramSimple, 0.97, 45),
    ("ngram-map-k", NgramMapK, 0.97, 45),
    ("ngram-map-k4v", NgramMapK4V, 0.97, 45),
    ("ngram-mod", lambda: NgramMod(table_size=1 << 20), 0.98, 35),
]


@pytest.mark.parametrize(
    "make, min_rate, max_steps", [s[1:] for s in LONG_SPECS], ids=[s[0] for s in LONG_SPECS]
)
def test_long_repetitive_generation_with_defaults(make, min_rate, max_steps):
    # a 4000-token prompt and 2000 generated tokens repeating a 300-token block: every drafter
    # must cover most generated tokens with accepted drafts, in few steps
    truth = periodic(300, 6000)
    spec = make()
    steps, accepted = generate(spec, truth, start=4000)
    assert accepted >= min_rate * 2000
    assert steps <= max_steps
    assert spec.stats.tokens_accepted == accepted


def test_random_text_gives_no_drafts():
    truth = random_tokens(0, 1500, 50_000)
    for spec in [NgramSimple(), NgramMapK(), NgramMapK4V(), NgramMod(table_size=1 << 20)]:
        steps, accepted = generate(spec, truth, start=1000)
        assert (steps, accepted, spec.stats.drafts_generated) == (500, 0, 0), spec.name


def test_defaults_and_names():
    assert (NgramSimple().n, NgramSimple().m) == (12, 48)
    assert (NgramMapK().n, NgramMapK().m, NgramMapK().min_hits) == (12, 48, 1)
    assert (NgramMapK4V().n, NgramMapK4V().m, NgramMapK4V().min_hits) == (12, 48, 1)
    mod = NgramMod()
    assert (mod.n_match, mod.n_min, mod.n_max, mod.table.size) == (24, 48, 64, 4 * 1024 * 1024)
    names = [cls.name for cls in (NgramSimple, NgramMapK, NgramMapK4V, NgramMod)]
    assert names == ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod"]


BAD_PARAMS = [
    ("simple-n-zero", NgramSimple, {"n": 0}, "n must be"),
    ("simple-m-float", NgramSimple, {"m": 2.0}, "m must be"),
    ("map-k-min-hits-zero", NgramMapK, {"min_hits": 0}, "min_hits must be"),
    ("k4v-n-bool", NgramMapK4V, {"n": True}, "n must be"),
    ("mod-n-match-zero", NgramMod, {"n_match": 0}, "n_match must be"),
    ("mod-n-min-above-n-max", NgramMod, {"n_min": 65}, "n_min must be"),
    ("mod-n-min-negative", NgramMod, {"n_min": -1}, "n_min must be"),
    ("mod-table-size-zero", NgramMod, {"table_size": 0}, "table_size must be"),
]


@pytest.mark.parametrize(
    "cls, kwargs, message", [b[1:] for b in BAD_PARAMS], ids=[b[0] for b in BAD_PARAMS]
)
def test_invalid_parameters(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)
