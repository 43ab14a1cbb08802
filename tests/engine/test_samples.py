"""n samples of one prompt share one prefill (engine/samples.py): the prompt's positions are
computed once, whatever the slots, and each sample's tokens are those of a lone request
with its seed (float64 tiny models, dense and hybrid, speculation on and off)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams, Status
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.loading.model import load_model
from specserve.models.registry import LanguageModel
from specserve.speculative.registry import build_speculator
from tests.tiny import VOCAB, write_hf_folder
from tests.tiny_hybrid import write_hybrid_folder

CTX = 160
N_TOKENS = 64
SEED = 40
NGRAMS = "ngram-map-k,suffix"


@functools.cache
def _model(arch: str) -> LanguageModel:
    folder = Path(tempfile.mkdtemp(prefix=f"specserve-samples-{arch}-"))
    if arch == "qwen3_5":
        write_hybrid_folder(arch, folder, seed=7, mtp=True)
    else:
        write_hf_folder(arch, folder, seed=3)
    model = load_model(folder, dtype="float64", with_tokenizer=False).model
    # peaky distributions over a strong embedding: at temperature 1 the text still repeats
    # itself (so n-gram drafts are made) and the seeds still make the samples differ
    with torch.no_grad():
        model.embed.weight.mul_(12.0)
        model.lm_head.weight.mul_(8.0)
        mtp = getattr(model, "mtp", None)
        if mtp is not None:  # the head reads the next token's embedding: good drafts
            d = model.cfg.hidden_size
            mtp.fc.weight.copy_(torch.cat((torch.eye(d), torch.zeros(d, d)), dim=1))
    return model


def _prompt() -> list[int]:
    body = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    return body + body[3:15]  # a repeat, so n-gram drafts are made and checked


def _engine(arch: str, slots: int, spec: str) -> Engine:
    runner = ModelRunner(_model(arch), slots, CTX)
    types = spec.split(",") if spec else []
    return Engine(runner, build_speculator(types, target=runner), prompt_cache=False)


def _request(seed: int, temperature: float = 1.0, spec: str = "") -> Request:
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=N_TOKENS)
    return Request(_prompt(), params, SpecParams(6 if spec else 0, 0, 0.0))


def _lone(arch: str, spec: str, seed: int, temperature: float = 1.0) -> list[int]:
    """The tokens of one request alone in a fresh engine."""
    (req,) = _engine(arch, 1, spec).generate([_request(seed, temperature, spec)])
    return req.output


def _count_prompt_rows(engine: Engine, prompt_len: int) -> list[int]:
    """Counts, from now on, the rows every forward computes at prompt positions."""
    rows = [0]
    forward, memory = engine.runner.forward, engine.runner.memory

    def counted(work: list[Any]) -> list[torch.Tensor]:
        for w in work:
            start = memory.length(w.slot)
            rows[0] += max(0, min(start + len(w.tokens), prompt_len) - start)
        return forward(work)

    engine.runner.forward = counted  # type: ignore[method-assign]
    return rows


def _run(engine: Engine, reqs: list[Request]) -> list[Request]:
    engine.add_samples(reqs)
    while engine.has_work():
        engine.step()
    return reqs


CASES = [
    pytest.param(arch, slots, spec, id=f"{arch}-{slots}slot-{spec or 'nospec'}")
    for arch in ("qwen2", "qwen3_5")
    for slots in (1, 3)
    for spec in ("", NGRAMS)
]


@pytest.mark.parametrize(("arch", "slots", "spec"), CASES)
def test_samples_share_one_prefill_and_equal_lone_requests(
    arch: str, slots: int, spec: str
) -> None:
    """Three sampled choices (temperature 1, seeds s, s+1, s+2): the prompt is computed once
    (with one slot the siblings wait and start from a saved copy), and choice i is the lone
    request with seed s+i, token for token."""
    engine = _engine(arch, slots, spec)
    prompt_rows = _count_prompt_rows(engine, len(_prompt()))
    reqs = _run(engine, [_request(SEED + i, spec=spec) for i in range(3)])
    assert prompt_rows[0] == len(_prompt())
    assert [r.timings.prompt_n for r in reqs] == [len(_prompt()), 0, 0]
    assert [r.timings.cache_n for r in reqs] == [0, len(_prompt()), len(_prompt())]
    for i, req in enumerate(reqs):
        assert req.finish_reason == "length"
        assert req.output == _lone(arch, spec, SEED + i), f"choice {i}"
    assert len({tuple(r.output) for r in reqs}) == 3  # the seeds do make them differ
    if spec:
        assert sum(r.timings.draft_n_accepted for r in reqs) > 0


@pytest.mark.parametrize(
    ("arch", "spec"), [("qwen2", NGRAMS), ("qwen3_5", NGRAMS), ("qwen3_5", "mtp")]
)
def test_greedy_samples_are_all_the_greedy_text(arch: str, spec: str) -> None:
    """Whatever their seeds; mtp drafts from the target's hidden states, copied too."""
    reqs = _run(_engine(arch, 2, spec), [_request(i, 0.0, spec) for i in range(3)])
    greedy = _lone(arch, "", 0, 0.0)
    assert [r.output for r in reqs] == [greedy] * 3


def test_the_first_sample_aborted_before_its_prefill_hands_it_to_a_sibling() -> None:
    engine = _engine("qwen2", 3, "")
    prompt_rows = _count_prompt_rows(engine, len(_prompt()))
    reqs = [_request(SEED + i) for i in range(3)]
    engine.add_samples(reqs)
    engine.abort(reqs[0])
    while engine.has_work():
        engine.step()
    assert reqs[0].finish_reason == "abort" and reqs[0].output == []
    assert prompt_rows[0] == len(_prompt())
    assert [r.timings.prompt_n for r in reqs[1:]] == [len(_prompt()), 0]
    assert [r.output for r in reqs[1:]] == [_lone("qwen2", "", SEED + i) for i in (1, 2)]


@pytest.mark.parametrize("when", ["pending", "late"])
def test_an_aborted_waiting_sibling_leaves_the_others_alone(when: str) -> None:
    """Aborted while its first sample prefills, or while it waits for a slot."""
    engine = _engine("qwen2", 1, "")
    reqs = [_request(SEED + i) for i in range(3)]
    engine.add_samples(reqs)
    if when == "late":
        engine.step()  # the prefill: the first decodes, the others wait with a saved copy
        assert reqs[0].status is Status.DECODE and len(engine.samples.late) == 2
    engine.abort(reqs[1])
    while engine.has_work():
        engine.step()
    assert reqs[1].finish_reason == "abort" and reqs[1].output == []
    assert [reqs[0].output, reqs[2].output] == [_lone("qwen2", "", SEED + i) for i in (0, 2)]


def test_a_failing_sibling_fails_alone() -> None:
    engine = _engine("qwen3_5", 3, NGRAMS)
    reqs = [_request(SEED + i, spec=NGRAMS) for i in range(3)]
    victim = reqs[1]
    sample, calls = engine._sample, [0]

    def flaky(req: Request, logits: torch.Tensor, draft: Any) -> Any:
        if req is victim:
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError("injected")
        return sample(req, logits, draft)

    engine._sample = flaky  # type: ignore[method-assign]
    _run(engine, reqs)
    assert victim.finish_reason == "error"
    assert [reqs[0].output, reqs[2].output] == [_lone("qwen3_5", NGRAMS, SEED + i) for i in (0, 2)]


def test_samples_must_share_their_prompt() -> None:
    engine = _engine("qwen2", 2, "")
    other = _request(1)
    other.prompt = other.prompt[:-1]
    with pytest.raises(Exception, match="share its prompt"):
        engine.add_samples([_request(0), other])
    assert not engine.has_work()
