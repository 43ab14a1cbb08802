"""The prompt cache: a slot's next request starts after the prefix its memory still holds,
and its output is the output of a full prefill, token for token (float64 tiny models,
greedy; plain transformer and hybrid, speculation on and off)."""

from __future__ import annotations

import copy
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
from specserve.models.registry import LanguageModel
from specserve.speculative.registry import build_speculator
from specserve.tokens import shared_prefix
from tests.tiny import VOCAB, add_noise, write_hf_folder
from tests.tiny_hybrid import write_hybrid_folder

CTX = 256


@functools.cache
def _model(arch: str) -> LanguageModel:
    folder = Path(tempfile.mkdtemp(prefix=f"specserve-pc-{arch}-"))
    if arch == "qwen3_5":
        write_hybrid_folder(arch, folder, seed=7, mtp=False)
    else:
        write_hf_folder(arch, folder, seed=3)
    return load_model(folder, dtype="float64", with_tokenizer=False).model


@functools.cache
def _noisy(arch: str) -> LanguageModel:
    """A draft model: the target with noise, so its drafts are often but not always right."""
    draft = copy.deepcopy(_model(arch))
    add_noise(draft, 0.1)
    return draft


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _request(prompt: list[int], n: int = 24, spec: bool = False, cache: bool = True) -> Request:
    req = Request(
        prompt, SamplingParams(temperature=0, max_tokens=n), SpecParams(6 if spec else 0, 0, 0.0)
    )
    req.cache_prompt = cache
    return req


def _engine(arch: str, slots: int = 1, spec: str = "", cache: bool = True) -> Engine:
    runner = ModelRunner(_model(arch), slots, CTX)
    drafter = ModelRunner(_noisy(arch), slots, CTX) if spec == "draft" else None
    speculator = build_speculator([spec], drafter, target=runner) if spec else None
    return Engine(runner, speculator, prompt_cache=cache)


def _fresh(arch: str, prompt: list[int], n: int = 24) -> list[int]:
    """The output of a full prefill in an engine that has seen nothing else."""
    (req,) = _engine(arch, cache=False).generate([_request(prompt, n)])
    return req.output


def test_shared_prefix() -> None:
    assert shared_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert shared_prefix([1, 2], [1, 2, 3]) == 2
    assert shared_prefix([], [1]) == 0
    assert shared_prefix([5], [6]) == 0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
@pytest.mark.parametrize("spec", ["", "draft"], ids=["plain", "draft-model"])
def test_follow_up_turn_prefills_only_its_new_tokens(arch: str, spec: str) -> None:
    """Turn 2 re-sends turn 1's prompt and answer plus a new message: only the message is
    prefilled (a hybrid model too: its state after turn 1 is exactly that prefix), and the
    answer equals a full prefill's."""
    engine = _engine(arch, spec=spec)
    body = _tokens(15, 1)
    (first,) = engine.generate([_request(body + body, spec=bool(spec))])
    held = len(first.context) - 1  # the last answer token is sampled, never fed
    assert engine.runner.memory.length(first.slot) == held
    follow = first.context + body[:9]
    (second,) = engine.generate([_request(follow, spec=bool(spec))])
    assert second.slot == first.slot
    assert second.timings.cache_n == held
    assert second.timings.prompt_n == len(follow) - held
    assert second.output == _fresh(arch, follow)
    if spec:  # speculation ran, and the draft model kept its own prefix too
        assert 0 < second.timings.draft_n_accepted < second.timings.draft_n
        assert engine.speculator is not None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
def test_shared_system_prompt_is_reused_where_state_allows(arch: str) -> None:
    """Two requests share only a leading part: attention KV is kept to that length, a
    recurrent state only to a point it can be restored to (here the start: no reuse)."""
    system = _tokens(20, 3)
    engine = _engine(arch)
    engine.generate([_request(system + _tokens(10, 4))])
    other = system + _tokens(12, 5)
    (req,) = engine.generate([_request(other)])
    assert req.timings.cache_n == (20 if arch == "qwen2" else 0)
    assert req.output == _fresh(arch, other)


def test_a_request_goes_to_the_slot_holding_its_prefix() -> None:
    engine = _engine("qwen2", slots=3)
    a, b = _tokens(25, 6), _tokens(25, 7)
    done = engine.generate([_request(a), _request(b)])
    slot_of = {tuple(r.prompt): r.slot for r in done}
    (again,) = engine.generate([_request(b + _tokens(4, 8))])
    assert again.slot == slot_of[tuple(b)]
    assert again.timings.cache_n == len(b)
    # a prompt sharing nothing takes the never-used slot, keeping both prefixes
    (new,) = engine.generate([_request(_tokens(25, 9))])
    assert new.slot not in slot_of.values()
    assert new.timings.cache_n == 0


def test_identical_prompt_still_feeds_its_last_token() -> None:
    engine = _engine("qwen2")
    prompt = _tokens(30, 10)
    (first,) = engine.generate([_request(prompt, n=1)])
    (again,) = engine.generate([_request(prompt)])
    assert again.timings.cache_n == len(prompt) - 1
    assert again.output == _fresh("qwen2", prompt)
    assert again.output[0] == first.output[0]


@pytest.mark.parametrize("engine_cache", [True, False], ids=["request-opts-out", "flag-off"])
def test_opting_out_prefills_everything(engine_cache: bool) -> None:
    engine = _engine("qwen2", cache=engine_cache)
    (first,) = engine.generate([_request(_tokens(30, 11))])
    follow = first.context + _tokens(5, 12)
    (second,) = engine.generate([_request(follow, cache=not engine_cache)])
    assert second.timings.cache_n == 0
    assert second.timings.prompt_n == len(follow)
    assert second.output == _fresh("qwen2", follow)


def test_aborted_request_leaves_a_usable_prefix() -> None:
    """Aborted half-way through its prefill, a request's slot holds the prefilled part."""
    engine = _engine("qwen2")
    engine.scheduler.prefill_chunk = 16
    prompt = _tokens(40, 13)
    req = engine.add_request(_request(prompt))
    engine.step()  # one 16-token chunk
    engine.abort(req)
    assert engine.runner.memory.length(req.slot) == 16
    (again,) = engine.generate([_request(prompt)])
    assert again.timings.cache_n == 16
    assert again.output == _fresh("qwen2", prompt)
