"""Build an engine (target, optional draft model, speculators) from plain settings.

The CLI, the server and the benchmarks all build engines through here, so a flag means
the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.engine import Engine
from specserve.engine.runner import ModelRunner
from specserve.errors import SpecserveError
from specserve.loading.model import LoadedModel, load_model
from specserve.spec.base import Speculator
from specserve.spec.registry import build_speculator, parse_types


@dataclass
class EngineSettings:
    model: str = "qwen2.5-coder-0.5b"
    dtype: str = "float32"
    device: str = "cpu"
    num_slots: int = 1
    ctx_size: int = 0  # 0 = min(model's context, 4096)
    spec_types: tuple[str, ...] = ()
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise SpecserveError(f"parallel slots (-np) must be >= 1, got {self.num_slots}")
        if self.ctx_size < 0:
            raise SpecserveError(f"--ctx-size must be >= 0, got {self.ctx_size}")
        self.spec_types = tuple(parse_types(self.spec_types))
        if self.draft_model and "draft" not in self.spec_types:
            self.spec_types = (*self.spec_types, "draft")


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must speak the target's tokens: same vocabulary, same ids."""
    tv, dv = target.cfg.vocab_size, draft.cfg.vocab_size
    same = tv == dv
    if same and target.tokenizer is not None and draft.tokenizer is not None:
        same = target.tokenizer.hf.get_vocab() == draft.tokenizer.hf.get_vocab()
    if not same:
        raise SpecserveError(
            f"draft model {draft.path.name} has another vocabulary than the target "
            f"({dv} vs {tv} tokens, or different ids); pick a draft from the same family"
        )


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_engine(
    s: EngineSettings,
    target: LoadedModel | None = None,
    progress: bool = True,
    draft: LoadedModel | None = None,
) -> tuple[Engine, LoadedModel]:
    """The engine the settings describe, and the loaded target (loaded here unless given).

    draft: the draft model, already loaded (benchmarks build many engines over the same
    weights); loaded from `s.draft_model` when the settings need one and it is not given.
    """
    target = target or load_model(s.model, s.dtype, device=s.device, progress=progress)
    ctx = s.ctx_size or min(target.cfg.context_length, 4096)
    runner = ModelRunner(target.model, num_slots=s.num_slots, max_len=ctx)
    speculator = _speculator(s, target, ctx, progress, draft)
    return Engine(runner, speculator), target


def _speculator(
    s: EngineSettings,
    target: LoadedModel,
    ctx: int,
    progress: bool,
    draft: LoadedModel | None = None,
) -> Speculator | None:
    if "draft" not in s.spec_types:
        return build_speculator(s.spec_types)
    if draft is None:
        if not s.draft_model:
            raise SpecserveError("--spec-type draft needs --draft-model")
        draft = load_model(s.draft_model, s.dtype, device=s.device, progress=progress)
    check_same_vocab(target, draft)
    draft_runner = ModelRunner(draft.model, num_slots=s.num_slots, max_len=ctx)
    # one draft forward costs about the size ratio of one target forward
    cost = param_count(draft.model) / param_count(target.model)
    return build_speculator(s.spec_types, draft_runner, cost)
