"""Exactness for hybrid (recurrent) targets: greedy output with every speculator and both
rollback strategies equals output without speculation, token for token (float64, 200
tokens, two slots at once so drafted and undrafted slots share verify forwards).

The tiny targets are tuned so that speculation has something to do: a large embedding
gain makes greedy text repeat with context-dependent variations (n-gram drafters hit and
miss), a larger lm_head makes draft probabilities peaky (so p_min cuts drafts at varying
lengths, down to zero), and the MTP head is wired to read the next token's embedding (so
its drafts are often right). None of that changes what exactness means.
"""

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
from specserve.models.qwen3_next import HybridTransformer
from specserve.speculative.base import Speculator
from specserve.speculative.registry import build_speculator
from tests.speculative.cases_seen import CasesSeen
from tests.tiny import VOCAB, add_noise, device_under_test
from tests.tiny_hybrid import write_hybrid_folder

N_TOKENS = 200
CTX = 320
N_MAX = 8


def _tune(model: HybridTransformer) -> HybridTransformer:
    with torch.no_grad():
        model.embed.weight.mul_(12.0)
        model.lm_head.weight.mul_(8.0)  # argmax unchanged; draft probabilities sharper
        if model.mtp is not None:
            d = model.cfg.hidden_size
            fc = torch.zeros(d, 2 * d, dtype=model.mtp.fc.weight.dtype)
            fc[:, :d] = torch.eye(d)  # pass the next token's embedding through
            model.mtp.fc.weight.copy_(fc)
    return model


def _noisy(model: HybridTransformer, scale: float) -> HybridTransformer:
    draft = copy.deepcopy(model)
    draft.mtp = None
    add_noise(draft, scale)
    return draft


@functools.cache
def _models(arch: str) -> tuple[HybridTransformer, HybridTransformer]:
    """(target, draft): a tuned tiny target and a noisy copy of it without MTP layers."""
    folder = Path(tempfile.mkdtemp(prefix=f"specserve-{arch}-"))
    write_hybrid_folder(arch, folder, seed=7)
    target = _tune(load_model(folder, dtype="float64", with_tokenizer=False).model)
    target = target.to(device_under_test())
    return target, _noisy(target, 0.1)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (40, 60):
        body = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        out.append(body + body[5:25])
    return out


def _run(
    target: HybridTransformer,
    prompts: list[list[int]],
    types: str = "",
    draft: HybridTransformer | None = None,
    rollback: str = "auto",
    depth: int = N_MAX + 1,
) -> tuple[list[list[int]], Speculator | None]:
    runner = ModelRunner(target, len(prompts), CTX, rollback=rollback, snapshot_depth=depth)
    draft_runner = ModelRunner(draft, len(prompts), CTX) if draft is not None else None
    spec = build_speculator(types.split(","), draft_runner, 0.3, target=runner) if types else None
    reqs = [
        Request(p, SamplingParams(temperature=0, max_tokens=N_TOKENS), SpecParams(N_MAX, 0, 0.5))
        for p in prompts
    ]
    Engine(runner, spec).generate(reqs)
    return [r.output for r in reqs], spec


@functools.cache
def _reference(arch: str) -> list[list[int]]:
    return [_run(_models(arch)[0], [p])[0][0] for p in _prompts()]


SEEN = CasesSeen()
SPECS = [
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
    "suffix",
    "draft",
    "mtp",
    "ngram-mod,draft,mtp",
]


# Qwen3.5 with every speculator; Qwen3-Next (MoE) with one of each kind
CASES = [("qwen3_5", t) for t in SPECS] + [("qwen3_next", t) for t in ("ngram-mod", "draft", "mtp")]


@pytest.mark.parametrize("rollback", ["snapshots", "checkpoint"])
@pytest.mark.parametrize(("arch", "types"), CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_speculation_equals_plain_greedy(arch: str, types: str, rollback: str) -> None:
    target, draft = _models(arch)
    out, spec = _run(target, _prompts(), types, draft, rollback)
    assert out == _reference(arch)
    assert spec is not None
    SEEN.add(spec.stats)


@pytest.mark.parametrize(
    ("rollback", "depth"), [("auto", N_MAX + 1), ("snapshots", 4)], ids=["auto", "shallow-snaps"]
)
def test_auto_and_snapshots_shallower_than_drafts_are_exact(rollback: str, depth: int) -> None:
    """auto mixes both strategies; drafts longer than the snapshot depth fall back to
    checkpoint + replay."""
    target, draft = _models("qwen3_5")
    out, _ = _run(target, _prompts(), "ngram-mod,draft", draft, rollback, depth)
    assert out == _reference("qwen3_5")


def test_empty_rejected_and_full_drafts_all_occurred() -> None:
    """Runs after the parametrized cases above (pytest keeps file order)."""
    SEEN.assert_all_occurred()


def test_a_follow_up_turn_with_mtp_reuses_its_prefix() -> None:
    """Qwen3.5's own MTP head and the prompt cache: turn 2 is prefilled after turn 1, the
    head drafts from the states of its new tokens alone, and the answer is a full
    prefill's."""
    target, _ = _models("qwen3_5")
    runner = ModelRunner(target, 1, CTX)
    engine = Engine(runner, build_speculator(["mtp"], target=runner))
    spec = SpecParams(N_MAX, 0, 0.5)
    params = SamplingParams(temperature=0, max_tokens=40)
    a = _prompts()[0]
    (first,) = engine.generate([Request(a, params, spec)])
    follow = first.context + a[:10]
    (second,) = engine.generate([Request(follow, params, spec)])
    assert second.timings.cache_n >= len(first.context) - 1
    assert second.output == _run(target, [follow])[0][0][:40]
    assert second.timings.draft_n_accepted > 0
