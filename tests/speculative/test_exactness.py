"""Exactness is the contract: greedy output with any speculator, draft length and number of
parallel slots equals output without speculation, token for token (tiny models, float64)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.models.layers.invariant import make_batch_invariant
from specserve.speculative.base import Speculator
from specserve.speculative.registry import build_speculator
from tests.speculative.cases_seen import CasesSeen
from tests.tiny import CHAR_END, VOCAB, constraint

N_TOKENS = 128
CTX = 320


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (70, 90, 75):
        body = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        out.append(body + body[10:40] + body[:5])  # a repeat, so n-gram lookups find matches
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS)


def _requests(
    model,  # noqa: ANN001
    speculator: Speculator | None,
    n_max: int,
    prompts: list[list[int]],
    params: SamplingParams = GREEDY,
    json: bool = False,
) -> list[Request]:
    engine = Engine(ModelRunner(model, num_slots=len(prompts), max_len=CTX), speculator)
    reqs = [Request(p, params, SpecParams(n_max=n_max, p_min=0.5)) for p in prompts]
    for r in reqs if json else []:
        r.constraint, r.stop_ids = constraint("json_object"), frozenset({CHAR_END})
    return engine.generate(reqs)


def _run(
    model,  # noqa: ANN001
    speculator: Speculator | None,
    n_max: int,
    prompts: list[list[int]],
    params: SamplingParams = GREEDY,
) -> list[list[int]]:
    return [r.output for r in _requests(model, speculator, n_max, prompts, params)]


@pytest.fixture(scope="module")
def reference(target) -> list[list[int]]:  # noqa: ANN001
    return [_run(target, None, 0, [p])[0] for p in _prompts()]


# what the speculators above did, summed, for the "every case occurred" test below
SEEN = CasesSeen()

SPECS = [
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
    "suffix",
    "draft",
    "ngram-map-k,suffix,draft",
]


@pytest.mark.parametrize("n_max", [1, 4, 16, 48])
@pytest.mark.parametrize("types", SPECS)
def test_speculation_equals_plain_greedy(
    types: str, n_max: int, target, close_draft, reference
) -> None:  # noqa: ANN001
    draft_runner = ModelRunner(close_draft, num_slots=3, max_len=CTX)
    spec = build_speculator(types.split(","), draft_runner, draft_cost=0.3)
    assert spec is not None
    prompts = _prompts()
    # three slots at once, and a single slot alone
    assert _run(target, spec, n_max, prompts) == reference
    assert _run(target, spec, n_max, prompts[1:2]) == reference[1:2]
    SEEN.add(spec.stats)


# Verification rows see what plain decoding would: penalties count the draft tokens before
# each row, the bias is added to every row, and a sampled row uses the uniform of its own
# position, so drafts without probabilities (n-gram, suffix) keep the output token for token
# at any temperature. (A draft model's drafts carry probabilities and go through rejection
# sampling: the same distribution, not the same tokens, so it joins only the greedy cases.)
SETTINGS = {
    "penalties": ("ngram-map-k,suffix,draft", dict(repetition_penalty=1.05, presence_penalty=0.2,
                                                   frequency_penalty=0.05)),
    "logit-bias": ("ngram-map-k,suffix,draft", dict(logit_bias={7: 1.5, 40: -100.0, 99: 3.0})),
    "sampled": ("ngram-map-k,suffix", dict(temperature=0.5, top_k=3, seed=7)),
    "sampled-penalties": ("ngram-map-k,suffix", dict(temperature=0.1, top_k=8, seed=7,
                                                     repetition_penalty=1.02)),
    "sampled-bias": ("ngram-simple,ngram-mod", dict(temperature=0.1, seed=7,
                                                    logit_bias={7: 1.5, 99: 3.0})),
}  # fmt: skip


@pytest.mark.parametrize("types, settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_speculation_equals_plain_with_sampling_settings(
    types: str, settings: dict, target, close_draft, reference
) -> None:  # noqa: ANN001
    params = SamplingParams(**{"temperature": 0, "max_tokens": N_TOKENS, **settings})
    prompts = _prompts()
    plain = _run(target, None, 0, prompts, params)
    assert plain != reference  # the settings change the output, so the test can fail
    draft_runner = ModelRunner(close_draft, num_slots=3, max_len=CTX)
    spec = build_speculator(types.split(","), draft_runner, draft_cost=0.3)
    assert spec is not None
    assert _run(target, spec, 16, prompts, params) == plain
    assert spec.stats.tokens_accepted > 0  # drafts were verified and kept


@pytest.fixture(scope="module")
def invariant_target(target):  # noqa: ANN001, ANN201
    """The target in --deterministic's batch-invariant mode."""
    import copy

    model = copy.deepcopy(target)
    make_batch_invariant(model)
    return model


@pytest.mark.parametrize(
    "types, settings, invariant",
    [
        ("ngram-map-k,suffix,draft", dict(temperature=0), True),
        (
            "ngram-map-k,suffix",
            dict(temperature=0.5, top_k=3, seed=7, repetition_penalty=1.02),
            False,
        ),
    ],
    ids=["greedy-deterministic", "sampled-penalties"],
)
def test_logprobs_with_speculation_equal_plain(
    types: str, settings: dict, invariant: bool, target, invariant_target, close_draft
) -> None:  # noqa: ANN001
    """Each token's log-probability and top 5 come from the row that decided it, so a
    verification row gives what a one-row decode step gives: to the bit in the batch-
    invariant mode, to float64 rounding (~1e-15) in the default one."""
    model = invariant_target if invariant else target
    params = SamplingParams(**{"max_tokens": 64, "logprobs": 5, **settings})
    prompts = _prompts()
    plain = _requests(model, None, 0, prompts, params)
    spec = build_speculator(types.split(","), ModelRunner(close_draft, 3, CTX), draft_cost=0.3)
    assert spec is not None
    fast = _requests(model, spec, 16, prompts, params)
    assert spec.stats.tokens_accepted > 0
    for a, b in zip(plain, fast, strict=True):
        assert b.output == a.output
        assert [e.token for e in a.logprobs] == a.output
        if invariant:
            assert b.logprobs == a.logprobs
            continue
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            got = [y.logprob] + [v for _, v in y.top]
            assert got == pytest.approx([x.logprob] + [v for _, v in x.top], abs=1e-12)


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=0), dict(temperature=0.7, top_k=20, seed=5)],
    ids=["greedy", "sampled"],
)
def test_json_mode_with_speculation_equals_plain(settings: dict, target, close_draft) -> None:  # noqa: ANN001
    """Verification rows judged in the grammar state after their draft prefix: the same
    JSON text with drafts (n-gram, suffix, and a draft model's, whose probabilities the
    constrained rule does not need) as without."""
    params = SamplingParams(**{"max_tokens": 96, **settings})
    prompts = _prompts()
    plain = _requests(target, None, 0, prompts, params, json=True)
    spec = build_speculator(
        ["ngram-map-k", "suffix", "draft"], ModelRunner(close_draft, 3, CTX), draft_cost=0.3
    )
    assert spec is not None
    fast = _requests(target, spec, 16, prompts, params, json=True)
    assert [r.output for r in fast] == [r.output for r in plain]
    assert spec.stats.tokens_accepted > 0
    for r in plain:
        body = r.output[:-1] if r.output[-1] == CHAR_END else r.output
        assert constraint("json_object").valid_prefix(body) == len(body)
    assert [r.output for r in plain] != [
        r.output for r in _requests(target, None, 0, prompts, params)
    ]


def test_empty_rejected_and_full_drafts_all_occurred() -> None:
    """Runs after the parametrized cases above (pytest keeps file order)."""
    SEEN.assert_all_occurred()
