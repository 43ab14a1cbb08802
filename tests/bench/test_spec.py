"""`specserve bench spec`: its pure helpers and flags (the benchmark needs real models)."""

from __future__ import annotations

import pytest

from specserve.bench.spec import CONFIGS, configs_for, first_difference, histogram
from specserve.cli import build_parser


@pytest.mark.parametrize(
    ("counts", "text"),
    [
        pytest.param([], "-", id="no-drafts"),
        pytest.param([5, 2, 0, 1, 0, 3], "0:5 1:2 3-4:1 5-8:3", id="buckets"),
        pytest.param([0] * 16 + [4], "9-16:4", id="all-accepted-16"),
        pytest.param([1] * 18, "0:1 1:1 2:1 3-4:2 5-8:4 9-16:8 17-32:1", id="every-length"),
    ],
)
def test_histogram(counts: list[int], text: str) -> None:
    assert histogram(counts) == text


@pytest.mark.parametrize(
    ("a", "b", "index"),
    [
        pytest.param([1, 2, 3], [1, 2, 3], None, id="equal"),
        pytest.param([1, 2, 3], [1, 5, 3], 1, id="differs"),
        pytest.param([1, 2, 3], [1, 2], 2, id="longer"),
        pytest.param([], [7], 0, id="empty"),
    ],
)
def test_first_difference(a: list[int], b: list[int], index: int | None) -> None:
    assert first_difference(a, b) == index


def test_draft_configs_are_skipped_for_the_draft_model_itself() -> None:
    args = build_parser().parse_args(["bench", "spec"])
    assert args.spec_types == list(CONFIGS)
    small = configs_for("qwen2.5-coder-0.5b", args)
    assert small[0] == "none"
    assert not any("draft" in c for c in small)
    assert configs_for("qwen2.5-coder-1.5b", args) == ["none", *CONFIGS]


def test_models_load_as_a_server_loads_them() -> None:
    args = build_parser().parse_args(["bench", "spec"])
    assert args.weights == "auto"  # `specserve serve`'s default, so tok/s is what users see
    assert build_parser().parse_args(["bench", "spec", "--weights", "dequant"]).weights == "dequant"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "spec", "--weights", "int3"])
