"""SuffixSpeculator: the trie against brute-force counts, the speculator against the reference."""

from __future__ import annotations

import doctest
import itertools
import random
from functools import partial

import pytest

from specserve.speculative import suffix, suffix_trie
from specserve.speculative.base import DraftRequest
from specserve.speculative.suffix import SuffixSpeculator, suffix_draft
from specserve.speculative.suffix_trie import SuffixTrie
from tests.speculative import drive
from tests.speculative.drive import distinct_tokens, draft, random_tokens

generate = partial(drive.generate, n_max=16)  # these drafters' tests use 16


@pytest.mark.parametrize("module", [suffix, suffix_trie], ids=lambda m: m.__name__.split(".")[-1])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# the trie ------------------------------------------------------------------------------------


def brute_stats(seqs: list[list[int]], pattern: list[int]) -> tuple[int, dict[int, list[int]]]:
    """(occurrences of pattern, token -> [times it followed, stamp of the latest such one])."""
    n, occurrences, stamp, follow = len(pattern), 0, 0, {}
    for seq in seqs:
        for end in range(n, len(seq) + 1):
            if seq[end - n : end] == pattern:
                occurrences += 1
                if end < len(seq):
                    entry = follow.setdefault(seq[end], [0, 0])
                    entry[0], entry[1] = entry[0] + 1, stamp + end
        stamp += len(seq)
    return occurrences, follow


def check_trie(trie: SuffixTrie, seqs: list[list[int]], vocab: int, depth: int) -> None:
    """Every string up to depth - 1 tokens: found iff it occurs; next token and share exact."""
    for n in range(1, depth):
        for pattern in map(list, itertools.product(range(vocab), repeat=n)):
            occurrences, follow = brute_stats(seqs, pattern)
            cursor = trie.locate(pattern)
            assert (cursor is not None) == (occurrences > 0), pattern
            if cursor is None:
                continue
            node, off = cursor
            if off == 0 and not trie.is_lazy(node):
                assert trie.count[node] == occurrences, pattern
            if off == 0 and trie.link[node] >= 0:  # the string without its first token
                assert trie.locate(pattern[1:]) == (trie.link[node], 0), pattern
            step = trie.next_token(cursor)
            if not follow:
                assert step is None, pattern
                continue
            best = max(follow, key=lambda t: tuple(follow[t]))  # most often, then latest
            total = sum(count for count, _ in follow.values())
            assert step == (best, follow[best][0] / total), pattern


@pytest.mark.parametrize("seed", range(8))
def test_trie_counts_match_brute_force(seed):
    rng = random.Random(seed)
    vocab, depth = rng.choice([2, 3]), rng.choice([2, 3, 5])
    seqs = [random_tokens(rng.randrange(10**9), rng.randrange(1, 40), vocab) for _ in range(4)]
    trie = SuffixTrie(depth)
    for seq in seqs:
        trie.add(seq)
    check_trie(trie, seqs, vocab, depth)
    for n_removed in range(1, len(seqs)):  # oldest first, as the global tree evicts
        trie.remove(seqs[n_removed - 1])
        check_trie(trie, seqs[n_removed:], vocab, depth)


@pytest.mark.parametrize("seed", range(4))
def test_trie_reuses_freed_nodes(seed):
    # the global tree's life: add, evict the oldest, add more (into freed node ids)
    rng = random.Random(seed)
    vocab, depth = rng.choice([2, 3]), rng.choice([3, 5])
    seqs = [random_tokens(rng.randrange(10**9), rng.randrange(1, 40), vocab) for _ in range(6)]
    trie = SuffixTrie(depth)
    for seq in seqs[:3]:
        trie.add(seq)
    for n in range(3, len(seqs)):
        trie.remove(seqs[n - 3])
        trie.add(seqs[n])
        check_trie(trie, seqs[n - 2 : n + 1], vocab, depth)
    peak = len(trie.count)
    for seq in seqs[-3:]:
        trie.remove(seq)
    assert trie.n_nodes() == 1 and not trie.multi and not trie.seqs  # only the root is left
    assert trie.locate([seqs[-1][0]]) is None
    trie.add(seqs[0])
    assert len(trie.count) <= peak  # grown into freed ids
    check_trie(trie, seqs[:1], vocab, depth)


def test_trie_memory_of_repeated_text():
    # text seen twice expands into ~depth nodes a token: they must stay small (the global
    # tree holds up to 128 Ki tokens); objects with a dict each took ~7 kB a token here
    seqs = [distinct_tokens(10 + i, 128) for i in range(4)]
    trie = SuffixTrie(depth=25)
    for seq in seqs + seqs:
        trie.add(seq)
    n_tokens = sum(map(len, seqs))
    assert trie.n_nodes() > 20 * n_tokens  # expanded: ~23 nodes a token
    assert trie.nbytes() < 1200 * n_tokens


# the speculator against the reference ---------------------------------------------------------

EXAMPLE = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]  # suffix_draft's docstring example
CASES = [  # id, context, earlier outputs, params, expected draft
    ("worked-example", EXAMPLE, [], {}, [5, 1, 2]),
    ("below-min-token-prob", EXAMPLE, [], {"min_token_prob": 0.6}, []),
    ("global-scores-higher", EXAMPLE, [[1, 2, 3, 4, 6, 6]], {}, [4, 6, 6]),
    ("alpha-2-drafts-2p", EXAMPLE, [], {"alpha": 2.0}, [5, 1, 2, 3, 5, 1]),
    ("alpha-half-floors", EXAMPLE, [], {"alpha": 0.5}, [5]),
    ("nothing-repeats", [1, 2, 3, 4, 5], [], {}, []),
    ("newest-occurrence-not-counted", [7, 8, 9, 7, 8], [], {}, [9, 7]),
    ("most-frequent-wins", [1, 5, 1, 5, 1, 6, 1], [], {}, [5]),
    ("tie-latest-wins", [1, 5, 1, 6, 1], [], {}, [6]),
    # pattern [4, 5, 6] (capped at max_depth 3): the draft runs past the trie's depth
    ("past-max-depth", [4, 5, 6] * 3, [], {"max_depth": 3, "alpha": 3.0}, [4, 5, 6] * 3),
    ("global-only", [9, 1, 2, 3], [[0, 1, 2, 3, 4, 5]], {}, [4, 5]),
    ("global-end-not-followed", [9, 1, 2, 3], [[0, 1, 2, 3]], {}, []),
]


@pytest.mark.parametrize(
    "context, outputs, params, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_cases(context, outputs, params, expected):
    assert suffix_draft(context, outputs, n_max=64, **params) == expected
    spec = SuffixSpeculator(**params)
    for output in outputs:
        spec.learn(output)
    spec.begin(0, context)
    assert draft(spec, 0, context) == expected


@pytest.mark.parametrize("seed", range(12))
def test_speculator_equals_reference(seed):
    # contexts grow by 1..3 tokens a step; finished outputs go to the global tree
    rng = random.Random(seed)
    vocab, max_depth = rng.choice([2, 3, 5]), rng.choice([2, 4, 24])
    alpha, min_prob = rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 0.5])
    cap = rng.choice([0, 30, 30, 1000, 1000])
    spec = SuffixSpeculator(max_depth, alpha, min_prob, max_global_tokens=cap)
    outputs: list[list[int]] = []  # what the global tree should hold
    for _ in range(4):
        tokens = random_tokens(rng.randrange(10**9), rng.randrange(2, 60), vocab)
        prompt_len = length = rng.randrange(1, len(tokens))
        spec.begin(0, tokens[:prompt_len])
        seen = prompt_len
        while length <= len(tokens):
            n_max = rng.choice([1, 5, 64])
            expected = suffix_draft(tokens[:length], outputs, n_max, max_depth, alpha, min_prob)
            assert draft(spec, 0, tokens[:length], n_max) == expected
            seen, length = length, length + rng.randrange(1, 4)
        spec.reset(0)
        output = tokens[prompt_len:seen][-cap:] if cap else []  # an output longer than cap
        while output and outputs and sum(map(len, outputs)) + len(output) > cap:
            outputs.pop(0)  # the oldest outputs make room
        outputs += [output] if output else []
        assert spec.global_tokens == sum(map(len, outputs))


# behaviour ----------------------------------------------------------------------------------


def test_random_text_gives_empty_drafts():
    spec = SuffixSpeculator()
    spec.learn(distinct_tokens(1, 300))
    steps, accepted = generate(spec, distinct_tokens(2, 400), start=100)
    assert (steps, accepted) == (300, 0)
    assert spec.stats.drafts_generated == 0


@pytest.mark.parametrize(
    "n_max, max_depth, alpha, expected",
    [(64, 24, 1.0, 24), (8, 24, 1.0, 8), (64, 8, 2.0, 16), (1, 24, 1.0, 1)],
    ids=["alpha-p-bound", "n-max-bound", "alpha-2-depth-8", "n-max-1"],
)
def test_long_repetitive_context_drafts_long(n_max, max_depth, alpha, expected):
    unit = distinct_tokens(3, 50)
    tokens = unit * 100  # 5000 tokens
    spec = SuffixSpeculator(max_depth=max_depth, alpha=alpha)
    spec.begin(0, tokens[:4000])
    for length in (4000, 4001, 4017, 5000):
        d = draft(spec, 0, tokens[:length], n_max)
        assert d == (tokens * 2)[length : length + expected]
        spec.accept(0, len(d))


def test_second_request_drafts_from_first_output():
    prompt, output = distinct_tokens(4, 50), distinct_tokens(5, 300)
    spec = SuffixSpeculator()
    first = generate(spec, prompt + output, start=50)
    spec.reset(0)
    second = generate(spec, prompt + output, start=50, slot=3)
    assert first == (300, 0)
    assert second[0] < 40 and second[1] > 260, second


def test_slots_are_independent():
    texts = {slot: random_tokens(slot, 200, 4) for slot in (0, 1, 2)}
    shared = SuffixSpeculator()
    alone = {slot: SuffixSpeculator() for slot in texts}
    for slot, tokens in texts.items():
        shared.begin(slot, tokens[:20])
        alone[slot].begin(slot, tokens[:20])
    for length in range(20, 200, 7):  # interleaved steps
        requests = [DraftRequest(slot, tokens[:length], 8) for slot, tokens in texts.items()]
        together = [d.tokens for d in shared.draft(requests)]
        assert together == [alone[r.slot].draft([r])[0].tokens for r in requests]


def test_reset_and_begin():
    spec = SuffixSpeculator()
    old = distinct_tokens(6, 40)
    spec.begin(0, old[:10])
    draft(spec, 0, old)  # the slot's output so far: old[10:]
    spec.begin(0, [1, 2, 3])  # reused without reset: the old output is learned, context gone
    assert spec.global_tokens == 30
    assert draft(spec, 0, [1, 2, 3, 1, 2]) == [3, 1]  # p = 2 tokens matched: at most 2
    assert draft(spec, 0, [1, 2, 3, 1, 2] + old[10:14]) == old[14:18]  # from the global tree
    spec.reset(0)
    assert spec.global_tokens == 30 + 6
    assert draft(spec, 5, old[20:25]) == old[25:30]  # no begin: the context is all prompt
    spec.reset(5)
    assert spec.global_tokens == 36  # nothing was emitted
    draft(spec, 6, [1, 2])
    draft(spec, 6, [1, 2, 7])
    draft(spec, 6, [8])  # a new sequence without begin(): the old one's output is learned
    assert spec.global_tokens == 37


def test_n_max_and_n_min_respected():
    tokens = [1, 2, 3, 4] * 20
    spec = SuffixSpeculator()
    spec.begin(0, tokens)
    for n_max in (1, 3, 24, 100):
        assert len(spec.draft([DraftRequest(0, tokens, n_max)])[0]) == min(n_max, 24)
    assert spec.draft([DraftRequest(0, tokens, 4, n_min=5)])[0].tokens == []


def test_stats_counted_by_base_class():
    unit = distinct_tokens(7, 30)
    spec = SuffixSpeculator()
    steps, accepted = generate(spec, unit * 6, start=30)
    stats = spec.stats
    assert stats.tokens_accepted == accepted > 100
    assert stats.drafts_accepted <= stats.drafts_generated <= steps
    assert sum(stats.accept_len_hist) == stats.drafts_generated
    assert stats.proposed_per_pos[0] == stats.drafts_generated
    assert stats.draft_seconds > 0


def test_global_tree_is_bounded():
    spec = SuffixSpeculator(max_global_tokens=100)
    outputs = [distinct_tokens(10 + i, 30) for i in range(10)]
    for output in outputs:
        spec.learn(output)
        assert spec.global_tokens <= 100
    assert spec.global_tokens == 90  # the last three outputs
    assert draft(spec, 0, [-1] + outputs[-1][:3]) == outputs[-1][3:6]
    assert draft(spec, 1, [-1] + outputs[-3][:3]) == outputs[-3][3:6]
    assert draft(spec, 2, [-1] + outputs[-4][:3]) == []  # removed
    none = SuffixSpeculator(max_global_tokens=0)
    none.learn(outputs[0])
    assert none.global_tokens == 0 and draft(none, 0, [-1] + outputs[0][:3]) == []


@pytest.mark.parametrize(
    "params",
    [{"max_depth": 0}, {"alpha": 0.0}, {"min_token_prob": 1.5}, {"max_global_tokens": -1}],
    ids=["depth-0", "alpha-0", "prob-above-1", "negative-cap"],
)
def test_invalid_parameters(params):
    with pytest.raises(ValueError):
        SuffixSpeculator(**params)
