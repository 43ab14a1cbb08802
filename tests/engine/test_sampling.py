"""Sampling: parameter validation, the filters on hand-made rows, penalties, randomness."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.engine.sampling import (
    SamplingParams,
    apply_logit_bias,
    apply_penalties,
    greedy,
    probs_from_logits,
    resolve_seed,
    sample,
)

P = [0.5, 0.3, 0.15, 0.05]  # a hand-made distribution; its logits are log(P)


def renorm(values: list[float]) -> list[float]:
    return [v / sum(values) for v in values]


# ---- SamplingParams ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"temperature": -0.1}, "temperature", id="negative-temperature"),
        pytest.param({"temperature": math.nan}, "temperature", id="nan-temperature"),
        pytest.param({"top_k": -1}, "top_k", id="negative-top-k"),
        pytest.param({"top_p": 0.0}, r"top_p must be in \(0, 1\]", id="top-p-zero"),
        pytest.param({"top_p": 1.5}, "top_p", id="top-p-above-one"),
        pytest.param({"min_p": -0.1}, "min_p", id="negative-min-p"),
        pytest.param({"min_p": 1.1}, "min_p", id="min-p-above-one"),
        pytest.param({"repetition_penalty": 0.0}, "repetition_penalty", id="zero-repetition"),
        pytest.param({"presence_penalty": 2.5}, "presence_penalty", id="presence-too-big"),
        pytest.param({"frequency_penalty": -3}, "frequency_penalty", id="frequency-too-small"),
        pytest.param({"logit_bias": {3: 101.0}}, "logit_bias values", id="bias-too-big"),
        pytest.param({"logit_bias": {-1: 1.0}}, "logit_bias keys", id="bias-negative-id"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="zero-max-tokens"),
        pytest.param({"stop_token_ids": [2, -1]}, "stop_token_ids", id="negative-stop-id"),
    ],
)
def test_sampling_params_rejects(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_off():
    params = SamplingParams(stop_token_ids=[7, 8])
    assert params.stop_token_ids == (7, 8)
    assert not params.greedy and not params.has_penalties
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(presence_penalty=0.5).has_penalties


# ---- the filters ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        pytest.param(SamplingParams(), P, id="all-off"),
        pytest.param(SamplingParams(temperature=0), [1, 0, 0, 0], id="greedy-one-hot"),
        pytest.param(
            SamplingParams(temperature=2.0), renorm([v**0.5 for v in P]), id="temperature-2"
        ),
        pytest.param(SamplingParams(top_k=2), renorm(P[:2] + [0, 0]), id="top-k-2"),
        pytest.param(SamplingParams(top_k=9), P, id="top-k-above-vocab"),
        pytest.param(SamplingParams(top_p=0.7), renorm(P[:2] + [0, 0]), id="top-p-0.7"),
        pytest.param(SamplingParams(top_p=0.9), renorm(P[:3] + [0]), id="top-p-0.9"),
        pytest.param(SamplingParams(top_p=0.3), [1, 0, 0, 0], id="top-p-keeps-one"),
        pytest.param(SamplingParams(min_p=0.25), renorm(P[:3] + [0]), id="min-p-0.25"),
        pytest.param(SamplingParams(min_p=0.7), [1, 0, 0, 0], id="min-p-0.7"),
        # after top-k the row is [.526, .316, .158]: top-p 0.8 then keeps two tokens
        pytest.param(
            SamplingParams(top_k=3, top_p=0.8), renorm(P[:2] + [0, 0]), id="top-p-after-top-k"
        ),
        pytest.param(
            SamplingParams(temperature=0, top_k=1, min_p=0.9), [1, 0, 0, 0], id="greedy-filtered"
        ),
    ],
)
def test_probs_from_logits(params: SamplingParams, expected: list[float]):
    probs = probs_from_logits(torch.tensor([P]).log(), params)
    torch.testing.assert_close(
        probs, torch.tensor([expected], dtype=torch.float32), atol=1e-6, rtol=0
    )


def test_top_k_ties_keep_the_lowest_token_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert probs_from_logits(logits, SamplingParams(top_k=1)).tolist() == [[0, 1, 0, 0]]
    assert probs_from_logits(logits, SamplingParams(temperature=0)).tolist() == [[0, 1, 0, 0]]
    assert greedy(logits) == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_answers_as_torch_argmax_on_ties_nan_and_infinities(dtype: torch.dtype) -> None:
    # float rows take numpy's argmax (faster); it must pick what torch's does
    nan, inf = float("nan"), float("inf")
    rows = [
        [2.0, 5.0, 5.0, 1.0],
        [1.0, nan, 3.0, nan],
        [-inf, -inf, -inf, -inf],
        [inf, 1.0, inf, 0.0],
    ]
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.tensor(rows), torch.randn(3, 4, generator=g)]).to(dtype)
    assert greedy(logits) == logits.argmax(dim=-1).tolist() == [1, 1, 0, 0, *greedy(logits)[4:]]
    wide = torch.randn(2, 151936, generator=g).to(dtype)
    assert greedy(wide) == wide.argmax(dim=-1).tolist()


def test_params_per_row_and_dtypes():
    logits = torch.tensor([P, P[::-1]]).log()
    rows = [SamplingParams(top_k=1), SamplingParams(top_p=0.9)]
    probs = probs_from_logits(logits, rows)
    torch.testing.assert_close(probs, torch.tensor([[1, 0, 0, 0], [0] + renorm(P[:3])[::-1]]))
    assert probs_from_logits(logits.double(), rows).dtype == torch.float64
    assert probs_from_logits(logits.bfloat16(), rows).dtype == torch.float32
    with pytest.raises(ValueError, match="3 SamplingParams for 2 rows"):
        probs_from_logits(logits, rows + rows[:1])


# ---- penalties -----------------------------------------------------------------------------


def test_penalties_on_a_hand_made_row():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, [params, SamplingParams()], [[0], [0]], [[1, 1, 2], [1]])
    # row 0: token 0 seen in the prompt (2 / 2); token 1 twice in the output
    # (-2 * 2 - 0.5 - 2 * 0.25); token 2 once (1 / 2 - 0.5 - 0.25); token 3 unseen
    assert got.tolist() == [[1.0, -5.0, -0.25, 0.5], [2.0, -2.0, 1.0, 0.5]]


def test_logit_bias_adds_to_every_row_and_leaves_the_input_alone():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    before = logits.clone()
    got = apply_logit_bias(logits, SamplingParams(logit_bias={1: 5.0, 3: -100.0}))
    assert got.tolist() == [[2.0, 3.0, 1.0, -99.5], [0.0, 5.0, 0.0, -100.0]]
    assert torch.equal(logits, before)  # the engine's logits buffer is not written
    assert apply_logit_bias(logits, SamplingParams()) is logits


def test_no_penalties_leave_logits_alone():
    logits = torch.randn(3, 5)
    torch.testing.assert_close(apply_penalties(logits, SamplingParams(), [], []), logits)


# ---- randomness ----------------------------------------------------------------------------


def test_sample_follows_the_distribution():
    n, p = 50_000, torch.tensor(renorm([5, 1, 0, 3, 1, 0, 2, 8]))
    tokens = sample(p.expand(n, -1), [42] * n, list(range(n)))
    freq = torch.bincount(tokens, minlength=len(p)).double() / n
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt()).all()
    assert freq[p == 0].sum() == 0


def test_sample_depends_only_on_its_own_row():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(16, 50, generator=gen), dim=-1)
    seeds, positions = list(range(100, 116)), list(range(7, 23))
    together = sample(probs, seeds, positions)
    alone = torch.cat(
        [sample(probs[i : i + 1], seeds[i : i + 1], positions[i : i + 1]) for i in range(16)]
    )
    perm = torch.randperm(16, generator=gen)
    shuffled = sample(probs[perm], [seeds[i] for i in perm], [positions[i] for i in perm])
    assert torch.equal(together, alone)
    assert torch.equal(together[perm], shuffled)


def test_fixed_seed_reproduces_other_seeds_differ():
    probs = torch.full((200, 10), 0.1)
    run = lambda seed: sample(probs, [seed] * 200, list(range(200)))  # noqa: E731
    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))


def test_resolve_seed():
    assert resolve_seed(17) == 17
    fresh = {resolve_seed(None) for _ in range(4)}
    assert len(fresh) == 4 and all(0 <= s < 2**63 for s in fresh)
