"""`specserve bench spec`: its pure helpers and flags (the benchmark needs real models)."""

from __future__ import annotations

import pytest

from specserve.bench.spec import CONFIGS, configs_for, main, rounds
from specserve.bench.spec_report import Run, first_difference, histogram, make_row, paired
from specserve.cli import build_parser
from specserve.errors import SpecserveError


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


def _runs(*tok_s: float) -> list[Run]:
    return [Run([1, 2], t, 1.0, None) for t in tok_s]


def test_speedup_is_the_median_of_each_rounds_own_ratio() -> None:
    """A slow spell during the first round's `none` run makes that round's ratio 3.0:
    paired, it is one ratio among three; as a ratio of median speeds (30 over 20) the
    chain would have read 1.5x."""
    ref = _runs(0.0)[0]
    plain, chain, head = _runs(10, 40, 20), _runs(30, 44, 21), _runs(27, 48, 20)
    row = make_row("m", "w", "chain", chain, ref, plain)
    assert row["speedup_runs"] == pytest.approx([3.0, 1.1, 1.05])
    assert row["speedup"] == pytest.approx(1.1) and row["versus"] is None
    row = make_row("m", "w", "head", head, ref, plain, versus=chain)
    assert row["versus_runs"] == pytest.approx([0.9, 48 / 44, 20 / 21])
    assert row["versus"] == pytest.approx(20 / 21)
    with pytest.raises(ValueError, match="rounds pair one to one"):
        paired(head, plain[:2])


class _Rounds:
    """A session that records the order it is asked to generate in."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def prompt(self, model: str, workload: str) -> list[int]:
        return [0]

    def prediction(self, model: str, workload: str) -> list[int]:
        return []

    def generate(self, model: str, config: str, prompt: list[int], **_: object) -> Run:
        self.order.append(config)
        return _runs(1.0)[0]


def test_rounds_alternate_their_order_and_reuse_the_reference() -> None:
    session, ref = _Rounds(), _runs(1.0)[0]
    runs = rounds(session, "m", "w", ["none", "a", "b"], ref, 3)  # type: ignore[arg-type]
    assert session.order == ["a", "b", "b", "a", "none", "none", "a", "b"]
    assert runs["none"][0] is ref and [len(r) for r in runs.values()] == [3, 3, 3]


def test_versus_must_be_a_benchmarked_configuration() -> None:
    args = build_parser().parse_args(["bench", "spec", "--spec-types", "suffix", "--versus", "x"])
    with pytest.raises(SpecserveError, match="--versus x"):
        main(args)
