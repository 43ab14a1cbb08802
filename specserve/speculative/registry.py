"""Speculator types by name (`--spec-type a,b,c`) -> one Speculator (a chain when several)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import import_module

from specserve.errors import SpecserveError
from specserve.models.eagle3 import Eagle3Head
from specserve.speculative.base import Speculator
from specserve.speculative.chain import ChainSpeculator
from specserve.speculative.draft_model import DraftModelSpeculator, DraftRunner
from specserve.speculative.eagle3 import Eagle3Speculator, Eagle3Target
from specserve.speculative.mtp import MtpSpeculator, MtpTarget

# name -> "module:Class" of the drafters that need nothing but their defaults
_SIMPLE = {
    "ngram-simple": "specserve.speculative.ngram:NgramSimple",
    "ngram-map-k": "specserve.speculative.ngram_map:NgramMapK",
    "ngram-map-k4v": "specserve.speculative.ngram_map:NgramMapK4V",
    "ngram-mod": "specserve.speculative.ngram_mod:NgramMod",
    "ngram-cache": "specserve.speculative.ngram_cache:NgramCacheSpeculator",
    "suffix": "specserve.speculative.suffix:SuffixSpeculator",
    "prediction": "specserve.speculative.prediction:PredictionSpeculator",
}
SPEC_TYPES = (*_SIMPLE, "draft", "mtp", "eagle3")


def parse_types(text: str | Sequence[str] | None) -> list[str]:
    """'ngram-mod,draft' or ['ngram-mod', 'draft'] -> validated names ('' / 'none' = none)."""
    if text is None:
        return []
    items = [
        part for item in ([text] if isinstance(text, str) else text) for part in item.split(",")
    ]
    names = [t.strip() for t in items if t.strip() and t.strip() != "none"]
    unknown = [t for t in names if t not in SPEC_TYPES]
    if unknown:
        raise SpecserveError(
            f"unknown speculative type(s) {', '.join(unknown)}; choose from {', '.join(SPEC_TYPES)}"
        )
    if len(set(names)) != len(names):
        raise SpecserveError(f"a speculative type is listed twice: {','.join(names)}")
    return names


def _simple(name: str) -> Speculator:
    module, cls = _SIMPLE[name].split(":")
    factory: Callable[[], Speculator] = getattr(import_module(module), cls)
    return factory()


def build_speculator(
    types: Sequence[str],
    draft_runner: DraftRunner | None = None,
    draft_cost: float = 0.0,
    target: MtpTarget | Eagle3Target | None = None,
    eagle3_head: Eagle3Head | None = None,
    eagle3_cost: float | None = None,
    eagle3_sample: bool = False,
) -> Speculator | None:
    """One speculator for the given types; None for none. `draft` needs draft_runner,
    `mtp` the target's runner (whose model must have MTP layers), `eagle3` the target's
    runner and a head loaded for it (loading/eagle3.py; its cost in target steps, by
    default from the weight bytes each reads)."""
    made: list[Speculator] = []
    names = parse_types(types)
    if "mtp" in names and "eagle3" in names:
        raise SpecserveError("mtp and eagle3 both read the target's hidden states: pick one")
    for name in names:
        if name == "draft":
            if draft_runner is None:
                raise SpecserveError("--spec-type draft needs --draft-model")
            made.append(DraftModelSpeculator(draft_runner, draft_cost))
        elif name == "mtp":
            if target is None or getattr(target.model, "mtp", None) is None:
                raise SpecserveError(
                    "--spec-type mtp needs a model whose weights have multi-token-prediction "
                    "layers (Qwen3-Next / Qwen3.5 with mtp.* tensors, or nextn in GGUF)"
                )
            made.append(MtpSpeculator.from_runner(target))
        elif name == "eagle3":
            if target is None or eagle3_head is None:
                raise SpecserveError("--spec-type eagle3 needs --draft-model: an EAGLE-3 head")
            head, cost = eagle3_head, eagle3_cost
            made.append(Eagle3Speculator(target, head, cost, eagle3_sample))  # type: ignore[arg-type]
        else:
            made.append(_simple(name))
    if not made:
        return None
    return made[0] if len(made) == 1 else ChainSpeculator(made)
