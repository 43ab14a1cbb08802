"""ngram-mod (llama.cpp's --spec-default): its shared hash table, added to in chunks, and its
drafts against the plain reference (ngram_mod_draft)."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.speculative.ngram_mod import (
    NgramHashTable,
    NgramMod,
    build_ngram_mod_table,
    ngram_mod_draft,
)
from tests.speculative.drive import draft, random_tokens
from tests.speculative.test_ngram import SMALL_TABLE


@pytest.mark.parametrize("n, size", [(1, 7), (3, 61), (4, 1 << 10)], ids=["n1-tiny", "n3", "n4"])
def test_hash_table_bulk_add_equals_one_by_one(n, size):
    tokens = random_tokens(n, 500, 20)
    bulk, single = NgramHashTable(n, size), NgramHashTable(n, size)
    bulk.add(tokens, 3, 400)
    for i in range(3, 400):
        window = tokens[i : i + n]
        bucket = single.hash(window) % size
        single.used += int(single.entries[bucket] == single.EMPTY)
        single.entries[bucket] = tokens[i + n]
    np.testing.assert_array_equal(bulk.entries, single.entries)
    assert bulk.used == single.used


def test_hash_is_llama_cpp_polynomial():
    table = NgramHashTable(3, 1 << 20)
    mult, mask = 6364136223846793005, (1 << 64) - 1
    expected = ((((0 * mult + 11) * mult + 22) & mask) * mult + 33) & mask
    assert table.hash([11, 22, 33]) == expected


@pytest.mark.parametrize("seed", range(4))
def test_ngram_mod_equals_reference_after_begin(seed):
    # vocabulary 6, n_match 3: long chains, and misses where an n-gram never occurred
    prompt = random_tokens(seed, 300, 6)
    for newest in range(6):
        spec = NgramMod(n_match=3, n_min=2, n_max=10, table_size=1 << 20)
        spec.begin(0, prompt)
        expected = ngram_mod_draft(build_ngram_mod_table(prompt, 3), prompt + [newest], 3, 2, 10)
        assert draft(spec, 0, prompt + [newest]) == expected


def test_ngram_mod_adds_new_ngrams_in_chunks_of_32():
    spec = NgramMod(n_match=2, n_min=1, n_max=4, table_size=SMALL_TABLE)
    prompt = [100 + i for i in range(10)]
    spec.begin(0, prompt)
    ctx = prompt + [1, 2, 3, 4, 5] + [200 + i for i in range(20)] + [1, 2]
    assert draft(spec, 0, ctx) == []  # only 28 tokens past i_last: [1, 2] -> 3 not added yet
    ctx += [300 + i for i in range(10)] + [1, 2]
    assert draft(spec, 0, ctx) == [300, 301, 302, 303]  # the later [1, 2] -> 300 overwrote -> 3


def test_ngram_mod_n_min_and_n_max():
    prompt = [9, 1, 2, 3, 4, 5, 6, 8]
    spec = NgramMod(n_match=1, n_min=3, n_max=4, table_size=SMALL_TABLE)
    spec.begin(0, prompt)
    assert draft(spec, 0, prompt + [1]) == [2, 3, 4, 5]  # chain of 7 capped at n_max
    assert draft(spec, 0, prompt + [5]) == []  # 5 -> 6 -> 8 -> miss: 2 < n_min
    assert draft(spec, 0, prompt + [1], n_max=2) == [2, 3]  # engine's n_max < n_min: clipped


def test_ngram_mod_needs_n_match_history_tokens():
    spec = NgramMod(n_match=3, n_min=1, n_max=4, table_size=SMALL_TABLE)
    spec.begin(0, [1, 2, 3, 4, 1, 2])
    assert draft(spec, 0, [1, 2, 3]) == []  # len(tokens) - 1 < n_match
    assert ngram_mod_draft({(1, 2, 3): 4}, [1, 2, 3], 3, 1, 4) == []


def test_ngram_mod_table_is_shared_across_slots():
    spec = NgramMod(n_match=2, n_min=2, n_max=4, table_size=SMALL_TABLE)
    spec.begin(0, [1, 2, 3, 4, 5, 6, 7])
    spec.begin(1, [9, 9, 9])
    assert draft(spec, 1, [9, 9, 9, 2, 3]) == [4, 5, 6, 7]


def test_ngram_mod_clears_crowded_table_at_begin():
    spec = NgramMod(n_match=1, n_min=1, n_max=2, table_size=8)
    spec.begin(0, [1, 2])
    assert spec.table.used == 1
    spec.begin(1, [3, 4, 5])  # 3 of 8 buckets used > 0.25
    assert spec.table.used == 0
    assert draft(spec, 0, [1, 2, 1]) == []


def test_ngram_mod_clears_table_after_5_low_rounds():
    spec = NgramMod(n_match=1, n_min=1, n_max=4, table_size=SMALL_TABLE)
    prompt = [1, 2, 3, 4, 5, 6]
    spec.begin(0, prompt)
    for round_ in range(5):
        assert draft(spec, 0, prompt + [1]) == [2, 3, 4, 5], f"round {round_}"
        spec.accept(0, 1 if round_ == 2 else 0)  # 1/4 is not low: the streak restarts
    assert spec.table.used > 0
    for _ in range(3):
        assert draft(spec, 0, prompt + [1]) == [2, 3, 4, 5]
        spec.accept(0, 0)
    assert spec.table.used == 0
    assert spec._seqs[0].i_last == 0 and spec._seqs[0].n_low == 0
