"""Alternatives to draft tokens (a token tree with one-token side branches, batch.py
`branches`): greedy output equals output without speculation, token for token, with 1 and 3
slots, as alternatives are kept (for the first draft token and later ones), missed and stand
beside drafts kept whole (tiny float64 target)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.speculative.base import Draft, DraftRequest, Speculator
from specserve.speculative.cost import ForwardCost
from specserve.speculative.registry import build_speculator
from specserve.speculative.verify import verify_greedy
from tests.tiny import VOCAB
from tests.tiny_eagle3 import foreseeing_head, nearly_bigram

N_TOKENS = 128
CTX = 320


class Forking(Speculator):
    """Knows each prompt's greedy answer and drafts around it, in turns per slot: the
    first token wrong with the right one an alternative (kept), wrong with wrong
    alternatives (missed), right throughout with an alternative beside (kept whole), or
    the second token wrong with the right one an alternative (kept after the first)."""

    name = "forking"

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__()
        self.answers = answers
        self.turns: dict[int, int] = {}

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for req in requests:
            prompt = next(p for p in self.answers if tuple(req.tokens[: len(p)]) == p)
            at = len(req.tokens) - len(prompt)
            ahead = self.answers[prompt][at : at + min(req.n_max, 3)]
            if not ahead:
                drafts.append(Draft())
                continue
            wrong = [(t + 1) % VOCAB for t in ahead]
            turn = self.turns[req.slot] = (self.turns.get(req.slot, -1) + 1) % 4
            if turn == 0:
                d = Draft([wrong[0], *ahead[1:]], alternatives=[(ahead[0] + 2) % VOCAB, ahead[0]])
            elif turn == 1:
                d = Draft(wrong, alternatives=[(ahead[0] + 2) % VOCAB])
            elif turn == 2 or len(ahead) < 2:
                d = Draft(ahead, alternatives=[wrong[0]])
            else:
                d = Draft([ahead[0], *wrong[1:]], alternatives=[ahead[1]], alt_at=[1])
            d.alt_probs = [0.5] * len(d.alternatives)
            d.alt_at = d.alt_at or [0] * len(d.alternatives)
            drafts.append(d)
        return drafts


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 55, 47)]


def _engine(model, spec: Speculator | None, slots: int) -> Engine:  # noqa: ANN001
    runner = ModelRunner(model, num_slots=slots, max_len=CTX)
    # verify rows nearly free: every draft is verified whole
    return Engine(runner, spec, cost=ForwardCost(measure=False, per_row=0.05))


def _generate(engine: Engine, prompts: list[list[int]], **params) -> list[Request]:  # noqa: ANN003
    sampling = SamplingParams(temperature=0, max_tokens=N_TOKENS, **params)
    reqs = [Request(p, sampling, SpecParams(n_max=4, alternatives=2)) for p in prompts]
    return engine.generate(reqs)


@pytest.fixture(scope="module")
def reference(target) -> list[list[int]]:  # noqa: ANN001
    return [r.output for p in _prompts() for r in _generate(_engine(target, None, 1), [p])]


@pytest.mark.parametrize("slots", [1, 3])
def test_kept_and_missed_alternatives_keep_greedy_exact(slots: int, target, reference) -> None:  # noqa: ANN001
    answers = {tuple(p): out for p, out in zip(_prompts(), reference, strict=True)}
    spec = Forking(answers)
    engine = _engine(target, spec, slots)
    prompts = _prompts()[:slots]
    assert [r.output for r in _generate(engine, prompts)] == reference[:slots]
    assert engine.branches_kept > 0  # an alternative was the target's token
    assert spec.stats.accept_len_hist[1] > 0  # a draft's first token, then an alternative
    assert engine.branches_verified > 2 * engine.branches_kept  # and many were not
    assert spec.stats.drafts_full > 0  # drafts kept whole with an alternative beside them
    assert spec.stats.accept_len_hist[0] > engine.branches_kept  # and none kept of these


def test_the_logprobs_of_a_kept_alternative_come_from_its_own_rows(target, reference) -> None:  # noqa: ANN001
    prompts = _prompts()[:1]
    plain = _generate(_engine(target, None, 1), prompts, logprobs=2)[0]
    answers = {tuple(prompts[0]): reference[0]}
    engine = _engine(target, Forking(answers), 1)
    forked = _generate(engine, prompts, logprobs=2)[0]
    assert engine.branches_kept > 0
    assert forked.output == plain.output
    for a, b in zip(forked.logprobs, plain.logprobs, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-9)


def test_sampled_and_penalised_requests_verify_no_alternatives(target) -> None:  # noqa: ANN001
    prompts = _prompts()[:1]
    engine = _engine(target, Forking({tuple(prompts[0]): [1] * N_TOKENS}), 1)
    _generate(engine, prompts, presence_penalty=0.5)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16)
    engine.generate([Request(prompts[0], params, SpecParams(n_max=4))])
    assert engine.branches_verified == 0


@pytest.mark.parametrize("slots", [1, 3])
def test_a_heads_runner_up_is_offered_and_sometimes_kept(slots: int, target) -> None:  # noqa: ANN001
    bigram = nearly_bigram(target)
    prompts = _prompts()[:slots]
    plain = [r.output for p in prompts for r in _generate(_engine(bigram, None, 1), [p])]
    runner = ModelRunner(bigram, num_slots=slots, max_len=CTX)
    head = foreseeing_head(bigram, noise=0.6).to(runner.device)
    spec = build_speculator(["eagle3"], target=runner, eagle3_head=head, eagle3_cost=0.05)
    # free rows: every runner-up is worth its row, however unsure the head is of it
    engine = Engine(runner, spec, cost=ForwardCost(measure=False, per_row=0.0))
    assert [r.output for r in _generate(engine, prompts)] == plain
    assert engine.branches_verified > engine.branches_kept > 0


def test_verify_greedy_keeps_the_alternative_the_target_chose() -> None:
    rows = torch.full((5, 8), -1.0, dtype=torch.float64)
    for row, best in enumerate([3, 6, 0, 2, 7]):  # [last, d1, d2, a1, a2]
        rows[row, best] = 1.0
    kept = verify_greedy(rows, [5, 6], [4, 3], [0, 0])
    assert (kept.tokens, kept.accepted, kept.branch) == ([3, 7], 1, 1)  # a2, then its row's
    assert verify_greedy(rows[:4], [5, 6], [4], [0]).tokens == [3]  # no alternative was right
    assert verify_greedy(rows, [5, 6], [4, 3], [0, 1]).tokens == [3]  # a2 is for d2
    rows[0, 3], rows[0, 5] = -1.0, 1.0  # d1 kept, d2 not: the target says 6 after it
    kept = verify_greedy(rows, [5, 1], [4, 6], [0, 1])
    assert (kept.tokens, kept.accepted, kept.branch) == ([5, 6, 7], 2, 1)
    kept = verify_greedy(rows, [5, 6], [4, 3], [0, 0])
    assert (kept.tokens, kept.branch) == ([5, 6, 0], None)  # the draft itself stands
