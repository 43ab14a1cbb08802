"""Tenants (a request's cache_salt) share nothing: no prompt prefix, and no speculator's
cross-request knowledge (suffix's global tree, ngram-cache's dynamic cache, ngram-mod's
table); requests of one tenant still share both (tiny float64 qwen2)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.loading.model import load_model
from specserve.speculative.rates import AcceptanceModel
from specserve.speculative.registry import build_speculator
from specserve.speculative.tenants import PerTenant
from tests.tiny import VOCAB, write_hf_folder


@functools.cache
def _model() -> torch.nn.Module:
    folder = Path(tempfile.mkdtemp(prefix="specserve-tenants-"))
    write_hf_folder("qwen2", folder, seed=2)
    return load_model(folder, dtype="float64", with_tokenizer=False).model


def _prompt() -> list[int]:
    g = torch.Generator().manual_seed(8)
    return torch.randint(0, VOCAB, (40,), generator=g).tolist()


def _request(salt: str | None, prompt: list[int]) -> Request:
    req = Request(prompt, SamplingParams(temperature=0, max_tokens=60), SpecParams(8, 0, 0.0))
    req.cache_salt = salt
    return req


def _run(engine: Engine, salt: str | None, prompt: list[int]) -> Request:
    return engine.generate([_request(salt, prompt)])[0]


# the n-gram sizes a 100-token text can feed: ngram-mod's default n_match is 24
TYPES = ["suffix", "ngram-cache", "ngram-mod"]


@pytest.mark.parametrize("types", TYPES)
def test_a_tenant_drafts_from_its_own_earlier_requests_only(types: str) -> None:
    """After tenant a's request, the same prompt from tenant b drafts exactly as on a new
    engine, while from tenant a it drafts from a's earlier output. The learnt acceptance
    rates (how long a draft is worth, no text) are set back before each, as they are
    shared by design."""
    prompt = _prompt()
    fresh = _run(Engine(ModelRunner(_model(), 1, 256), build_speculator([types])), "b", prompt)
    engine = Engine(ModelRunner(_model(), 1, 256), build_speculator([types]), prompt_cache=False)
    spec = engine.speculator
    assert spec is not None
    first = _run(engine, "a", prompt)
    spec.rates, spec.worth.explored = AcceptanceModel(), 0
    other = _run(engine, "b", prompt)
    spec.rates, spec.worth.explored = AcceptanceModel(), 0
    same = _run(engine, "a", prompt)
    assert first.output == other.output == same.output == fresh.output
    drafted = [(r.timings.draft_n, r.timings.draft_n_accepted) for r in (fresh, other, same)]
    assert drafted[1] == drafted[0]
    assert drafted[2] != drafted[0] and drafted[2][1] >= drafted[0][1], drafted


def test_a_prompt_prefix_is_reused_within_a_tenant_only() -> None:
    prompt = _prompt()
    engine = Engine(ModelRunner(_model(), 3, 256))  # a slot each: none is taken from a
    _run(engine, "a", prompt)
    assert _run(engine, "b", prompt).timings.cache_n == 0
    assert _run(engine, None, prompt).timings.cache_n == 0
    assert _run(engine, "a", prompt).timings.cache_n == len(prompt) - 1


def test_per_tenant_forgets_the_least_recently_used() -> None:
    made: list[int] = []
    tables = PerTenant(lambda: made.append(1) or len(made), limit=2)
    assert (tables["a"], tables["b"], tables["a"]) == (1, 2, 1)
    assert tables["c"] == 3 and len(tables) == 2  # b went: a was used after it
    assert tables["a"] == 1 and tables["b"] == 4
