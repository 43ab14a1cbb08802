"""Build an engine (target, optional draft model, speculators) from plain settings.

The CLI, the server and the benchmarks all build engines through here, so a flag means
the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.cache.store import PromptStore, default_budget
from specserve.engine.engine import Engine
from specserve.engine.idle_cores import IdleCores
from specserve.engine.rollback import STRATEGIES
from specserve.engine.runner import DEFAULT_SNAPSHOT_DEPTH, ModelRunner
from specserve.engine.threads import ThreadTuner
from specserve.errors import SpecserveError
from specserve.loading.eagle3 import load_eagle3, own_head_name
from specserve.loading.model import LoadedModel, load_model, parse_dtype
from specserve.models.eagle3 import Eagle3Head
from specserve.models.layers.invariant import make_batch_invariant
from specserve.models.layers.quant import draft_mode
from specserve.models.size import step_bytes
from specserve.speculative.base import Speculator
from specserve.speculative.cost import SEED_ROWS, ForwardCost
from specserve.speculative.registry import build_speculator, parse_types


@dataclass
class EngineSettings:
    model: str = "qwen2.5-coder-0.5b"
    dtype: str = "float32"
    device: str = "cpu"
    num_slots: int = 1
    ctx_size: int = 0  # 0 = min(model's context, 4096)
    spec_types: tuple[str, ...] = ()
    draft_model: str | None = None
    # an EAGLE-3 head (`eagle3`): a path or a name in $SPECSERVE_CACHE/heads; None: the
    # model's own, `<model>-eagle3` (loading/eagle3.py)
    draft_head: str | None = None
    draft_probs: bool = False  # eagle3: sampled requests get sampled drafts with probabilities
    weights: str = "dequant"  # dequant | int8 | int6 | int5 | int4 | auto (models/layers/quant.py)
    # the draft model's and EAGLE-3 head's --weights (auto: DRAFT_AUTO); None: the target's
    draft_weights: str | None = None
    deterministic: bool = False  # batch-invariant kernels (models/layers/invariant.py)
    prepack: bool = True  # float32 CPU linears on oneDNN's packed weights (layers/packed.py)
    threads: int = 0  # torch threads; 0 = 1 or all per forward, as measured (engine/threads.py)
    cache_prompt: bool = True  # a slot's next request reuses the prefix it holds
    cache_ram_mb: float | None = None  # the prompt store's budget; None: from free memory
    # recurrent (hybrid) models: how verification rolls state back (engine/rollback.py)
    rollback: str = "auto"  # snapshots | checkpoint | auto
    snapshot_depth: int = DEFAULT_SNAPSHOT_DEPTH  # n_rs_seq = draft max + 1
    snapshot_budget_mb: float | None = None  # most memory `auto` spends on snapshots

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise SpecserveError(f"parallel slots (-np) must be >= 1, got {self.num_slots}")
        if self.ctx_size < 0:
            raise SpecserveError(f"--ctx-size must be >= 0, got {self.ctx_size}")
        if self.cache_ram_mb is not None and self.cache_ram_mb < 0:
            raise SpecserveError(f"--cache-ram must be >= 0 MiB, got {self.cache_ram_mb}")
        if self.rollback not in STRATEGIES:
            raise SpecserveError(
                f"--rollback must be one of {', '.join(STRATEGIES)}, got {self.rollback!r}"
            )
        self.spec_types = tuple(parse_types(self.spec_types))
        if "eagle3" in self.spec_types and "draft" not in self.spec_types and self.draft_model:
            # as llama.cpp's -md: with only a head asked for, the draft model is the head
            self.draft_head, self.draft_model = self.draft_head or self.draft_model, None
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


def load(s: EngineSettings, spec: str, progress: bool, weights: str | None = None) -> LoadedModel:
    """Load a target or draft model the way the settings say (weights: --weights, if not
    the target's)."""
    loaded = load_model(
        spec,
        s.dtype,
        device=s.device,
        progress=progress,
        weights=weights or s.weights,
        prepack=s.prepack,
    )
    if s.deterministic:
        make_batch_invariant(loaded.model)
    return loaded


def build_engine(
    s: EngineSettings,
    target: LoadedModel | None = None,
    progress: bool = True,
    draft: LoadedModel | None = None,
    cost: ForwardCost | None = None,
) -> tuple[Engine, LoadedModel]:
    """The engine the settings describe, and the loaded target (loaded here unless given).

    draft: the draft model, already loaded (benchmarks build many engines over the same
    weights); loaded from `s.draft_model` when the settings need one and it is not given.
    cost: the row costs to time forwards into, shared with other engines over the same
    weights (`bench spec --lockstep`); the engine's own unless given.
    """
    target = target or load(s, s.model, progress)
    ctx = s.ctx_size or min(target.cfg.context_length, 4096)
    budget = None if s.snapshot_budget_mb is None else int(s.snapshot_budget_mb * 2**20)
    runner = ModelRunner(
        target.model,
        num_slots=s.num_slots,
        max_len=ctx,
        rollback=s.rollback,
        snapshot_depth=s.snapshot_depth,
        snapshot_budget=budget,
    )
    speculator = _speculator(s, target, runner, progress, draft)
    # drafts are cut to what verifying them costs on this machine, as measured while serving
    cost = cost if cost is not None else ForwardCost(measure=True)
    engine = Engine(runner, speculator, cost=cost, threads=_threads(s), prompt_cache=s.cache_prompt)
    if speculator is not None:
        cost.seed(runner.time_rows, [n for n in SEED_ROWS if n <= ctx])
    mb = s.cache_ram_mb
    budget = default_budget() if mb is None else int(mb * 2**20)
    engine.prompts.use_store(PromptStore(budget), speculator)
    return engine, target


def _threads(s: EngineSettings) -> ThreadTuner | None:
    """--threads N pins torch to N; 0 (default) on CPU tunes 1 vs all per forward."""
    if s.threads > 0:
        torch.set_num_threads(s.threads)
        return None
    return ThreadTuner(idle=IdleCores()) if torch.device(s.device).type == "cpu" else None


def _speculator(
    s: EngineSettings,
    target: LoadedModel,
    runner: ModelRunner,
    progress: bool,
    draft: LoadedModel | None = None,
) -> Speculator | None:
    """runner: the target's (the mtp and eagle3 speculators draft from its hidden states)."""
    head = _eagle3_head(s, target, runner) if "eagle3" in s.spec_types else None
    if "draft" not in s.spec_types:
        return build_speculator(
            s.spec_types, target=runner, eagle3_head=head, eagle3_sample=s.draft_probs
        )
    if draft is None:
        if not s.draft_model:
            raise SpecserveError("--spec-type draft needs --draft-model")
        draft = load(s, s.draft_model, progress, draft_weights(s))
    check_same_vocab(target, draft)
    # a hybrid draft model rolls back to checkpoints it sets itself: no snapshot buffers
    mem = runner.memory
    draft_runner = ModelRunner(draft.model, mem.num_slots, mem.max_len, rollback="checkpoint")
    # decoding is memory-bound: a draft forward costs about its share of weight bytes
    cost = step_bytes(draft.model) / step_bytes(target.model)
    return build_speculator(
        s.spec_types,
        draft_runner,
        cost,
        target=runner,
        eagle3_head=head,
        eagle3_sample=s.draft_probs,
    )


def _eagle3_head(s: EngineSettings, target: LoadedModel, runner: ModelRunner) -> Eagle3Head:
    """The head --draft-head (or --draft-model, alone) names, else the model's own."""
    name = s.draft_head or own_head_name(s.model)
    return load_eagle3(name, target.cfg, runner.dtype, runner.device, draft_weights(s))


def draft_weights(s: EngineSettings) -> str:
    """The --weights of the settings' draft model and head."""
    if s.draft_weights is None:
        return s.weights
    return draft_mode(s.draft_weights, parse_dtype(s.dtype), s.device)
