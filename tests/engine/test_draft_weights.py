"""--draft-weights: a draft model and an EAGLE-3 head load on their own kernels (int4 under
auto), the target on its --weights, and greedy output stays the target's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.cli import build_parser
from specserve.engine.engine import Engine
from specserve.engine.flags import settings_from_args
from specserve.engine.request import Request, SpecParams
from specserve.engine.sampling import SamplingParams
from specserve.engine.setup import EngineSettings, build_engine
from specserve.loading.eagle3 import save_eagle3
from specserve.loading.model import LoadedModel, load_model
from tests.tiny import write_hf_folder
from tests.tiny_eagle3 import random_head

CTX = 96
INT4 = {"Q4Linear", "Int4Linear"}  # ours, or torch's where ours do not build
INT8 = {"Q8Linear", "Int8Linear"}


def kernels(module: torch.nn.Module) -> set[str]:
    """The classes of the module's linears (float ones as nn.Linear)."""
    names = {type(m).__name__ for m in module.modules()}
    return names & (INT4 | INT8 | {"Linear"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("draft-weights") / "tiny"
    write_hf_folder("qwen2", folder, seed=11)
    return folder


def _target(folder: Path) -> LoadedModel:
    return load_model(folder, "float32", with_tokenizer=False, weights="int8")


def _greedy(engine: Engine, n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n)
    req = Request([3, 1, 4, 1, 5, 9, 2, 6], params, SpecParams(n_max=4, p_min=0.0))
    engine.generate([req])
    return list(req.output)


def test_a_draft_model_runs_on_int4_under_auto(tiny: Path) -> None:
    target = _target(tiny)
    s = EngineSettings(str(tiny), "float32", weights="int8", spec_types=("draft",),
                       draft_model=str(tiny), draft_weights="auto", ctx_size=CTX)  # fmt: skip
    engine, _ = build_engine(s, target=target, progress=False)
    draft = engine.speculator.runner.model  # type: ignore[union-attr]
    assert kernels(target.model) <= INT8 and kernels(draft) <= INT4 and kernels(draft)
    # priced as a far smaller draft model would be, so that the value model asks it
    engine.speculator.relative_cost = 0.05  # type: ignore[union-attr]
    plain, _ = build_engine(EngineSettings(str(tiny), "float32", weights="int8", ctx_size=CTX),
                            target=target, progress=False)  # fmt: skip
    # the int4 draft proposes other tokens than the int8 target would, and is kept or not
    assert _greedy(engine, 48) == _greedy(plain, 48)
    stats = engine.speculator.stats  # type: ignore[union-attr]
    assert stats.drafts_generated > 0  # its drafts were verified


def test_a_head_follows_draft_weights_and_none_means_the_targets(tiny: Path) -> None:
    target = _target(tiny)
    head_dir = tiny.parent / "head"
    save_eagle3(random_head(target.cfg), head_dir)
    for draft_weights, want in (("auto", INT4), ("int8", INT8), (None, INT8)):
        s = EngineSettings(str(tiny), "float32", weights="int8", spec_types=("eagle3",),
                           draft_head=str(head_dir), draft_weights=draft_weights,
                           ctx_size=CTX)  # fmt: skip
        engine, _ = build_engine(s, target=target, progress=False)
        head = engine.speculator.head  # type: ignore[union-attr]
        assert kernels(head) <= want and kernels(head), draft_weights


def test_the_server_flag_defaults_to_auto() -> None:
    args = build_parser().parse_args(["serve", "--model", "some/tiny.gguf"])
    assert settings_from_args(args).draft_weights == "auto"
    args = build_parser().parse_args(["serve", "-m", "x.gguf", "--draft-weights", "int8"])
    assert settings_from_args(args).draft_weights == "int8"
    assert EngineSettings().draft_weights is None  # the library's default: the target's


def test_auto_keeps_floats_where_no_quantized_kernel_runs() -> None:
    from specserve.models.layers.quant import draft_mode

    assert draft_mode("auto", torch.float32, "cpu") == "int4"
    assert draft_mode("auto", torch.bfloat16, "cpu") == "int4"
    assert draft_mode("auto", torch.float64, "cpu") == "auto"  # loads as dequant, like --weights
    assert draft_mode("auto", torch.float32, "cuda") == "auto"
    assert draft_mode("int8", torch.float32, "cpu") == "int8"
