"""`bench decode --by-kind` on a tiny GGUF model: every low-bit call lands in one group of
its own shape and kinds, every group is timed at every row count, and the table's `all`
row is the groups' sum."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.bench.decode import print_by_kind
from specserve.bench.lowbit_rows import (
    ROWS,
    call_groups,
    kinds_table,
    pairs_table,
    time_groups,
)
from specserve.cli import build_parser
from specserve.loading.model import load_model
from specserve.models.layers.lowbit import LowbitCall
from specserve.ops.cpu.build import problem
from tests.tiny import make_hf_model
from tests.tiny_gguf import write_gguf

needs_lowbit = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")


def _model(tmp_path: Path, weights: str):  # noqa: ANN202 (an nn.Module)
    path = write_gguf(make_hf_model("qwen2", seed=3), "qwen2", tmp_path / "m.gguf")
    return load_model(path, "float32", with_tokenizer=False, weights=weights).model


@needs_lowbit
def test_every_call_is_grouped_and_timed_at_every_row_count(tmp_path: Path) -> None:
    model = _model(tmp_path, "int8")
    calls = [m for m in model.modules() if isinstance(m, LowbitCall)]
    groups = call_groups(model)
    assert sorted(id(c) for cs in groups.values() for c in cs) == sorted(id(c) for c in calls)
    for (k, n, kinds), members in groups.items():
        assert all(
            (c.in_features, c.out_features, tuple(c.parts()[1])) == (k, n, kinds) for c in members
        )
    assert any(len(kinds) > 1 for _, _, kinds in groups)  # fused q/k/v or gate/up
    times = time_groups(groups, rounds=1)
    assert set(times) == {(key, m) for key in groups for m in ROWS}
    assert all(t > 0 for t in times.values())


def test_the_table_sums_the_groups_and_divides_by_one_row() -> None:
    a, b = (64, 96, (2, 2)), (256, 32, (4,))
    groups = {a: [object(), object()], b: [object()]}  # only counted
    times = {(key, m): (1 + m) * 1e-3 * (2 if key == b else 1) for key in (a, b) for m in ROWS}
    lines = kinds_table(groups, times).splitlines()  # type: ignore[arg-type]
    cells = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")]
        for line in lines
        if "|" in line
    }
    assert cells["64 x 96"][2] == "q5+q5" and cells["256 x 32"][2] == "q4k"
    # all: 3 calls; at 1 row 2 + 4 ms, at 8 rows 9 + 18; 2 rows over 1: 9 / 6
    assert cells["all"][0] == "3"
    assert cells["all"][3] == "6.000" and cells["all"][3 + len(ROWS) - 1] == "27.000"
    assert cells["all"][3 + len(ROWS)] == "1.50"


def test_a_model_without_low_bit_calls_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    print_by_kind("tiny", "float32", _model(tmp_path, "dequant"), rounds=1)
    assert "no low-bit calls" in capsys.readouterr().out


def test_the_flag_parses() -> None:
    args = build_parser().parse_args(["bench", "decode", "--by-kind"])
    assert args.by_kind
    assert not build_parser().parse_args(["bench", "decode"]).by_kind


@needs_lowbit
def test_pairs_are_timed_from_each_start_at_every_row_count() -> None:
    from specserve.models.layers.lowbit_pairs import kernel_pair_rows, time_pairs

    seen: list[tuple[int, int]] = []
    was = kernel_pair_rows(5)
    try:
        times = time_pairs(lambda m: seen.append((kernel_pair_rows(), m)), [4, 1], 2, ROWS)
        assert kernel_pair_rows() == 5  # the setting before is back
    finally:
        kernel_pair_rows(was)
    cases = {(start, m) for start in (4, 1) for m in ROWS}
    assert set(times) == cases and all(len(t) == 2 for t in times.values())
    assert sorted(seen) == sorted(list(cases) * 3)  # a warm round and two timed
    # each row count's two settings run side by side, the first of them alternating
    assert all(seen[i][1] == seen[i + 1][1] for i in range(0, len(seen), 2))
    assert [seen[i][0] for i in (0, 2 * len(ROWS))] == [4, 1]


def test_the_pairs_table_divides_by_one_row_at_the_first_start() -> None:
    # timed in a shuffled order: the table follows the starts as asked, not the timings'
    times = {
        (start, m): (1 + m) * 1e-3 / (2 if start == 1 else 1) for start in (1, 4) for m in ROWS
    }
    out = pairs_table(times, [4, 1])
    assert out.startswith("one row at pairs from 4: 2.00 ms")
    rows = {line.split("|")[0].strip(): line for line in out.splitlines() if "|" in line}
    assert [c.strip() for c in rows["1"].split("|")][1:3] == ["0.500", "0.750"]
    assert [c.strip() for c in rows["4"].split("|")][1:3] == ["1.000", "1.500"]


def test_pair_rows_parses_positive_counts(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "decode", "--pair-rows", "4,1"])
    assert args.pair_rows == [4, 1]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "decode", "--pair-rows", "4,0"])
    assert "must be at least 1" in capsys.readouterr().err
