"""Verification: greedy tables, exact "spec on == spec off" sampling, rejection statistics."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.engine.sampling import sample
from specserve.speculative.base import Draft
from specserve.speculative.verify import (
    Stream,
    VerifyResult,
    position_uniforms,
    sample_from_probs,
    verify,
    verify_greedy,
    verify_rejection,
    verify_sampled,
)

V = 8


def logits_for(targets: list[int], vocab: int = V) -> torch.Tensor:
    """[len(targets), V] logits whose row i has its argmax at targets[i]."""
    logits = torch.zeros(len(targets), vocab)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


def one_hot(targets: list[int], vocab: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(targets), vocab).float()


def random_probs(n: int, gen: torch.Generator, vocab: int = V) -> torch.Tensor:
    return torch.softmax(1.5 * torch.randn(n, vocab, generator=gen, dtype=torch.float64), -1)


# ---- greedy -------------------------------------------------------------------------------

# (draft d1..dk, target argmax of rows [last, d1..dk], expected accepted, expected tokens)
GREEDY_CASES = [
    pytest.param([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4], id="all-accepted-plus-bonus"),
    pytest.param([1, 2, 3], [5, 2, 3, 4], 0, [5], id="none-accepted"),
    pytest.param([1, 2, 3], [1, 6, 3, 4], 1, [1, 6], id="partial-correction"),
    pytest.param([1, 2, 3], [1, 2, 7, 4], 2, [1, 2, 7], id="last-draft-rejected"),
    pytest.param([], [4], 0, [4], id="empty-draft"),
    pytest.param([3], [3, 3], 1, [3, 3], id="single-draft-repeat"),
]


@pytest.mark.parametrize(("draft", "targets", "accepted", "tokens"), GREEDY_CASES)
def test_verify_greedy(draft: list[int], targets: list[int], accepted: int, tokens: list[int]):
    assert verify_greedy(logits_for(targets), draft) == VerifyResult(accepted, tokens)


@pytest.mark.parametrize(("draft", "targets", "accepted", "tokens"), GREEDY_CASES)
@pytest.mark.parametrize("with_probs", [False, True], ids=["no-draft-probs", "draft-probs"])
def test_one_hot_rows_reduce_every_rule_to_greedy(
    draft: list[int], targets: list[int], accepted: int, tokens: list[int], with_probs: bool
):
    """Greedy slots reach verify as one-hot rows; both stochastic rules must then be greedy."""
    gen = torch.Generator().manual_seed(0)
    probs = random_probs(len(draft), gen) if with_probs else None
    rows = one_hot(targets)
    for seed in range(20):
        got = verify(rows, Draft(draft, probs), probs=rows, seed=seed, position=11)
        assert got == VerifyResult(accepted, tokens)


def test_greedy_rejects_wrong_row_count():
    with pytest.raises(ValueError, match=r"\[k \+ 1, V\]"):
        verify_greedy(logits_for([1, 2]), [1, 2])


# ---- drafts without probabilities: identical to plain sampling ----------------------------


def target_row(context: list[int]) -> torch.Tensor:
    """A fixed stand-in for the target model: context -> [V] distribution."""
    key = 17
    for t in context:
        key = (key * 1_000_003 + t) % (1 << 61)
    gen = torch.Generator().manual_seed(key)
    return torch.softmax(1.5 * torch.randn(V, generator=gen, dtype=torch.float64), dim=-1)


def target_rows(context: list[int], draft: list[int]) -> torch.Tensor:
    """[k + 1, V] rows for [last, d1..dk]."""
    return torch.stack([target_row(context + draft[:i]) for i in range(len(draft) + 1)])


def decode_plain(prompt: list[int], seed: int, n: int) -> list[int]:
    context = list(prompt)
    for _ in range(n):
        context += sample(target_row(context)[None], [seed], [len(context)]).tolist()
    return context[len(prompt) :]


def oracle_draft(context: list[int], truth: list[int], gen: torch.Generator) -> list[int]:
    """A drafter that knows the right answer but corrupts it at random, with random k."""
    k = int(torch.randint(0, 5, (), generator=gen))
    done = len(context)
    draft = []
    for i in range(k):
        right = truth[done + i] if done + i < len(truth) else 0
        wrong = float(torch.rand((), generator=gen)) < 0.3
        draft.append(int(torch.randint(0, V, (), generator=gen)) if wrong else right)
    return draft


@pytest.mark.parametrize("seed", [0, 1, 2**40 + 7])
def test_sampled_verification_equals_plain_decoding(seed: int):
    prompt, n = [3, 1, 4], 40
    truth = prompt + decode_plain(prompt, seed, n)
    gen = torch.Generator().manual_seed(seed)
    context, accepted, rejected = list(prompt), 0, 0
    while len(context) < len(truth):
        draft = oracle_draft(context, truth, gen)
        result = verify_sampled(target_rows(context, draft), draft, seed, len(context))
        accepted += result.accepted
        rejected += result.accepted < len(draft)
        context += result.tokens
    assert context[: len(truth)] == truth
    assert accepted > 10 and rejected > 2  # the drafts really were partly kept


# ---- drafts with probabilities: rejection sampling ----------------------------------------


def test_empty_draft_with_probs_is_plain_sampling():
    p = random_probs(1, torch.Generator().manual_seed(3))
    for seed in range(10):
        got = verify_rejection(p, [], torch.empty(0, V), seed=seed, position=5)
        assert got.tokens == sample(p, [seed], [5]).tolist()


def test_rejection_sampling_emits_the_target_distribution():
    """B independent slots (seeds 0..B-1), each a 2-token draft drawn from q; the emitted
    tokens must follow p, at the first position, after an acceptance, and as the bonus."""
    b, k = 100_000, 2
    gen = torch.Generator().manual_seed(1234)
    p, q = random_probs(1, gen)[0], random_probs(1, gen)[0]
    draft = torch.multinomial(q.expand(b, V), k, replacement=True, generator=gen).tolist()
    rows, draft_rows = p.expand(k + 1, V), q.expand(k, V)
    results = [verify_rejection(rows, draft[s], draft_rows, seed=s, position=0) for s in range(b)]

    first = torch.tensor([r.tokens[0] for r in results])
    assert_follows(first, p)
    assert_far(first, q)  # the test can tell p from q
    second = torch.tensor([r.tokens[1] for r in results if r.accepted >= 1])
    assert_follows(second, p)
    bonus = torch.tensor([r.tokens[k] for r in results if r.accepted == k])
    assert_follows(bonus, p)
    # the first coin accepts with probability sum_x min(p, q)
    rate = sum(r.accepted >= 1 for r in results) / b
    expected = float(torch.minimum(p, q).sum())
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / b)


def tolerance(p: torch.Tensor, n: int) -> torch.Tensor:
    """Five standard deviations of an empirical frequency from n samples (binomial)."""
    return 5 * (p * (1 - p) / n).sqrt() + 1e-12


def assert_follows(tokens: torch.Tensor, p: torch.Tensor) -> None:
    freq = torch.bincount(tokens, minlength=V).double() / len(tokens)
    assert ((freq - p).abs() <= tolerance(p, len(tokens))).all(), (freq, p)


def assert_far(tokens: torch.Tensor, q: torch.Tensor) -> None:
    freq = torch.bincount(tokens, minlength=V).double() / len(tokens)
    assert ((freq - q).abs() > tolerance(q, len(tokens))).any()


# ---- reproducibility ---------------------------------------------------------------------


def random_batch(gen: torch.Generator, slots: int) -> tuple[list[Draft], torch.Tensor]:
    """Slots with random draft lengths (0..4), some with draft probabilities."""
    drafts = []
    for _ in range(slots):
        k = int(torch.randint(0, 5, (), generator=gen))
        tokens = torch.randint(0, V, (k,), generator=gen).tolist()
        has_probs = bool(torch.rand((), generator=gen) < 0.5)
        drafts.append(Draft(tokens, random_probs(k, gen) if has_probs else None))
    target = random_probs(sum(len(d) + 1 for d in drafts), gen)
    return drafts, target


def verify_each(
    drafts: list[Draft], target: torch.Tensor, seeds: list[int], positions: list[int]
) -> list[VerifyResult]:
    """Every slot verified on its own rows of `target`."""
    out, row = [], 0
    for d, s, pos in zip(drafts, seeds, positions, strict=True):
        rows = target[row : row + len(d) + 1]
        out.append(verify(rows, d, probs=rows, seed=s, position=pos))
        row += len(d) + 1
    return out


def test_fixed_seed_is_reproducible_and_seeds_differ():
    gen = torch.Generator().manual_seed(8)
    drafts, target = random_batch(gen, slots=40)
    run = lambda seed: verify_each(drafts, target, [seed] * 40, list(range(40)))  # noqa: E731
    assert run(123) == run(123)
    assert run(123) != run(124)


# ---- the randomness primitives -------------------------------------------------------------


def test_position_uniforms_are_keyed_and_in_range():
    u = position_uniforms([1] * 1000, list(range(1000)))
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u[10:20], position_uniforms([1] * 10, list(range(10, 20))))
    assert abs(float(u.mean()) - 0.5) < 0.05
    other = position_uniforms([1] * 1000, list(range(1000)), Stream.ACCEPT)
    assert not torch.equal(u, other)
    assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 0.1


@pytest.mark.parametrize(
    ("probs", "u", "token"),
    [
        pytest.param([0.5, 0.5, 0.0, 0.0], 1 - 2**-53, 1, id="top-end-skips-zero-tail"),
        pytest.param([0.0, 0.0, 1.0], 2**-53, 2, id="bottom-end-skips-zero-head"),
        pytest.param([0.2, 0.0, 0.8], 0.2, 2, id="boundary-goes-right-past-zero"),
        pytest.param([2.0, 6.0], 0.3, 1, id="unnormalised"),
    ],
)
def test_sample_from_probs_inverse_cdf(probs: list[float], u: float, token: int):
    got = sample_from_probs(torch.tensor([probs]), torch.tensor([u], dtype=torch.float64))
    assert got.tolist() == [token]
