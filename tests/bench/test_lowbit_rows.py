"""`bench decode --by-kind` on a tiny GGUF model: every low-bit call lands in one group of
its own shape and kinds, every group is timed at every row count, and the table's `all`
row is the groups' sum."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.bench.decode import print_by_kind
from specserve.bench.lowbit_rows import ROWS, call_groups, kinds_table, time_groups
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
