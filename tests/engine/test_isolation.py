"""One request cannot fail another: sampling extremes are normalised, an exception in one
request's sampling or verification fails it alone, and a failed forward is recomputed
(float64 tiny models; the surviving requests' tokens equal an undisturbed run's)."""

from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams, probs_from_logits
from specserve.loading.model import load_model
from specserve.speculative.registry import build_speculator
from tests.tiny import VOCAB, write_hf_folder
from tests.tiny_hybrid import write_hybrid_folder

CTX = 256
N_TOKENS = 40


@functools.cache
def _model(arch: str) -> torch.nn.Module:
    folder = Path(tempfile.mkdtemp(prefix=f"specserve-isolation-{arch}-"))
    if arch == "qwen2":
        write_hf_folder(arch, folder, seed=5)
    else:
        write_hybrid_folder(arch, folder, seed=7)
    return load_model(folder, dtype="float64", with_tokenizer=False).model


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        body = torch.randint(0, VOCAB, (12 + 5 * i,), generator=g).tolist()
        out.append(body + body[2:9])  # a repeat, so n-gram drafts are made and checked
    return out


def _engine(arch: str = "qwen2", slots: int = 3, types: str = "ngram-map-k,suffix") -> Engine:
    runner = ModelRunner(_model(arch), slots, CTX)
    return Engine(runner, build_speculator(types.split(",")) if types else None)


def _requests(params: list[SamplingParams]) -> list[Request]:
    return [
        Request(p, s, SpecParams(8, 0, 0.0))
        for p, s in zip(_prompts(len(params)), params, strict=True)
    ]


def _greedy(n: int = 3) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=N_TOKENS) for _ in range(n)]


def _mixed() -> list[SamplingParams]:
    """Greedy, seeded sampling and penalties side by side."""
    return [
        SamplingParams(temperature=0, max_tokens=N_TOKENS),
        SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=N_TOKENS),
        SamplingParams(temperature=0.7, seed=9, repetition_penalty=1.3, max_tokens=N_TOKENS),
    ]


def _outputs(engine: Engine, params: list[SamplingParams]) -> list[list[int]]:
    return [r.output for r in engine.generate(_requests(params))]


# -- sampling values at their limits ----------------------------------------------------------


EXTREMES = {
    "temperature-5e-324": dict(temperature=5e-324),
    "temperature-1e-6": dict(temperature=1e-6),
    "top_p-1e-45": dict(temperature=1.0, top_p=1e-45, seed=1),
    "top_k-2**63": dict(temperature=0.0, top_k=2**63),
    "top_k-2**63-top_p-tiny": dict(temperature=2.0, top_k=2**63, top_p=1e-30, seed=2),
}


@pytest.mark.parametrize("fields", EXTREMES.values(), ids=EXTREMES.keys())
def test_sampling_extremes_give_the_greedy_text(fields: dict[str, Any]) -> None:
    """Each extreme leaves one token to choose: the greedy one, never an id past the vocab."""
    greedy = _outputs(_engine(slots=1), [SamplingParams(temperature=0, max_tokens=N_TOKENS)])
    extreme = _outputs(_engine(slots=1), [SamplingParams(max_tokens=N_TOKENS, **fields)])
    assert extreme == greedy


def test_a_row_without_finite_mass_falls_back_to_the_raw_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [1.0, math.nan, 2.0], [math.inf, 1.0, math.inf]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0))
    assert torch.isfinite(probs).all()
    assert probs[1].tolist() == [0.0, 0.0, 1.0]  # NaN counts as -inf
    assert probs[2].tolist() == [1.0, 0.0, 0.0]  # inf: the first of the largest
    assert probs[0].argmax().item() == 1 and 0 < probs[0, 0] < probs[0, 1]


# -- one request's failure stays its own ------------------------------------------------------


def test_an_exception_in_one_requests_verification_fails_it_alone() -> None:
    expected = _outputs(_engine(), _mixed())
    engine = _engine()
    reqs = _requests(_mixed())
    victim = reqs[1]
    sample = engine._sample
    calls = {"n": 0}

    def flaky(req: Request, logits: torch.Tensor, draft: Any) -> Any:
        if req is victim:
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("injected")
        return sample(req, logits, draft)

    engine._sample = flaky  # type: ignore[method-assign]
    outs = {r.id: [] for r in reqs}
    failed = []
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for out in engine.step():
            outs[out.request.id] += out.tokens
            if out.error is not None:
                failed.append(out.request)
    assert failed == [victim] and victim.finish_reason == "error"
    assert [reqs[0].output, reqs[2].output] == [expected[0], expected[2]]
    # the slot it left is clean: a new request there gives the undisturbed tokens again
    again = _requests(_mixed())[1]
    engine._sample = sample  # type: ignore[method-assign]
    assert engine.generate([again])[0].output == expected[1]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
def test_a_failed_forward_is_recomputed_with_the_same_tokens(arch: str) -> None:
    """A forward fails mid-generation; every request still ends with its usual tokens
    (recomputed from its prompt and output, randomness keyed by position)."""
    expected = _outputs(_engine(arch), _mixed())
    engine = _engine(arch)
    forward = engine.runner.forward
    calls = {"n": 0}

    def flaky(work: list[Any]) -> list[torch.Tensor]:
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("injected forward failure")
        return forward(work)

    engine.runner.forward = flaky  # type: ignore[method-assign]
    reqs = _requests(_mixed())
    errors = []
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        errors += [o.error for o in engine.step() if o.error is not None]
    assert errors == [] and all(r.recomputed for r in reqs)
    assert [r.output for r in reqs] == expected


def test_a_request_that_breaks_every_forward_fails_alone() -> None:
    expected = _outputs(_engine(), _greedy())
    engine = _engine()
    reqs = _requests(_greedy())
    culprit = reqs[2]
    forward = engine.runner.forward

    def breaks_with_culprit(work: list[Any]) -> list[torch.Tensor]:
        running = culprit.slot >= 0 and not culprit.finished and len(culprit.output) >= 3
        if running and any(w.slot == culprit.slot for w in work):
            raise RuntimeError("the culprit's forward")
        return forward(work)

    engine.runner.forward = breaks_with_culprit  # type: ignore[method-assign]
    for r in reqs:
        engine.add_request(r)
    failed = []
    while engine.has_work():
        failed += [o.request for o in engine.step() if o.error is not None]
    assert failed == [culprit] and culprit.finish_reason == "error"
    assert [reqs[0].output, reqs[1].output] == expected[:2]


def test_a_failing_speculator_costs_drafts_not_requests() -> None:
    expected = _outputs(_engine(types=""), _greedy())
    engine = _engine()
    assert engine.speculator is not None

    def broken(_: Any) -> Any:
        raise RuntimeError("injected drafter bug")

    engine.speculator.draft = broken  # type: ignore[method-assign]
    assert _outputs(engine, _greedy()) == expected
