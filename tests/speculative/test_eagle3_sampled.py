"""`eagle3` with --draft-probs: a sampled request's drafts are drawn from the head's
distribution q and verified by rejection sampling. The output must follow the target's
distribution as plain sampling does (compared position by position over many seeds), a seed
must still give one text, and the head's probabilities must buy kept drafts."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.speculative.base import Speculator
from specserve.speculative.cost import ForwardCost
from specserve.speculative.registry import build_speculator
from tests.tiny import VOCAB
from tests.tiny_eagle3 import foreseeing_head, nearly_bigram

N_SEEDS = 3000
N_TOKENS = 4
PROMPT = [5, 17, 99, 3, 42, 8, 77, 61]


@pytest.fixture(scope="module")
def bigram(target):  # noqa: ANN001, ANN201
    """Sharper than the tiny model (its LM head x6): a few tokens take most of the mass, as
    in a real model; the tiny one's near-uniform rows would hide a wrong distribution."""
    model = nearly_bigram(target)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return model


def sample(model, seeds: range, draft: str | None, temperature: float = 1.0):  # noqa: ANN001, ANN201
    """Each seed's N_TOKENS sampled tokens after PROMPT; draft: None (plain), "argmax" or
    "probs" (the head's drafts with --draft-probs)."""
    runner = ModelRunner(model, num_slots=16, max_len=32)
    spec: Speculator | None = None
    if draft is not None:
        head = foreseeing_head(model, noise=0.6).to(runner.device)
        spec = build_speculator(
            ["eagle3"],
            target=runner,
            eagle3_head=head,
            eagle3_cost=0.05,
            eagle3_sample=draft == "probs",
        )
    params = [SamplingParams(temperature=temperature, max_tokens=N_TOKENS, seed=s) for s in seeds]
    reqs = [Request(list(PROMPT), p, SpecParams(n_max=3, p_min=0.0)) for p in params]
    Engine(runner, spec, cost=ForwardCost(measure=False, per_row=0.0)).generate(reqs)
    return torch.tensor([r.output for r in reqs]), spec


def same_distribution(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two samples of one categorical, by the chi-square test of homogeneity: the statistic
    within 6 standard deviations of its mean under the same distribution (dof, sd
    sqrt(2 dof)); the tiny model's tokens are spread thin, so no per-token test would do."""
    ca = torch.bincount(a, minlength=VOCAB).double()
    cb = torch.bincount(b, minlength=VOCAB).double()
    seen = (ca + cb) > 0
    ca, cb = ca[seen], cb[seen]
    pooled = (ca + cb) / (len(a) + len(b))
    ea, eb = pooled * len(a), pooled * len(b)
    stat = float(((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum())
    dof = int(seen.sum()) - 1
    return stat <= dof + 6 * math.sqrt(2 * dof)


def test_sampled_drafts_keep_the_target_distribution(bigram) -> None:  # noqa: ANN001
    plain, _ = sample(bigram, range(N_SEEDS), None)
    drafted, spec = sample(bigram, range(N_SEEDS, 2 * N_SEEDS), "probs")
    assert spec is not None
    stats = spec.stats
    assert stats.tokens_accepted > 0.2 * stats.tokens_generated  # drafts were kept
    assert stats.tokens_accepted < stats.tokens_generated  # and some were refused
    for pos in range(N_TOKENS):  # the first, after kept drafts, after refused ones
        assert same_distribution(drafted[:, pos], plain[:, pos]), pos
    # the test can tell distributions apart: at temperature 0.7 the tokens differ
    cooler, _ = sample(bigram, range(2 * N_SEEDS, 3 * N_SEEDS), None, temperature=0.7)
    assert not all(same_distribution(cooler[:, i], plain[:, i]) for i in range(N_TOKENS))


def test_a_seed_gives_one_text_and_probabilities_keep_more(bigram) -> None:  # noqa: ANN001
    seeds = range(400)
    once, with_probs = sample(bigram, seeds, "probs")
    again, _ = sample(bigram, seeds, "probs")
    assert torch.equal(once, again)  # the drafts' own draws are seeded too
    argmax_out, argmax = sample(bigram, seeds, "argmax")
    plain, _ = sample(bigram, seeds, None)
    assert torch.equal(argmax_out, plain)  # argmax drafts: seeded text as without them
    assert with_probs is not None and argmax is not None
    kept = with_probs.stats.acceptance_rate
    assert kept > argmax.stats.acceptance_rate + 3 * math.sqrt(0.25 / 400)
