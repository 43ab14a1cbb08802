"""`specserve bench serve` end to end on the tiny model: a real server, real OpenAI clients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.bench.serve import Row, medians, run_order
from specserve.bench.serve_load import FLAT_MIB, Sample, judge_flat
from specserve.cli import main


def test_bench_serve_runs_one_and_two_slots_without_errors(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "serve", "--model", str(tiny_folder), "--dtype", "float64"]
    argv += ["--device", "cpu", "--threads", "1", "--slots", "1", "2", "--spec", "on"]
    argv += ["--clients", "2", "--requests-per-client", "2", "--max-tokens", "8"]
    argv += ["--repeats", "2"]
    # in-process: a server subprocess spends ~5-10 s importing torch before it listens
    argv += ["--in-process", "--out", str(tmp_path / "serve")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "aggregate tok/s" in out and "speedup vs 1 slot" in out
    record = json.loads((tmp_path / "serve.json").read_text())
    rows = record["rows"]
    assert [(r["slots"], r["spec"], r["runs"]) for r in rows] == [(1, "on", 2), (2, "on", 2)]
    # two rounds, the second in reverse order
    assert [r["slots"] for r in record["runs"]] == [1, 2, 2, 1]
    for r in rows + record["runs"]:
        # greedy on a random tiny model: no end-of-text early, so every request runs to 8
        assert (r["requests"], r["errors"], r["tokens"]) == (4, 0, 4 * 8), r
        assert r["tok_s"] > 0 and r["ttft_s"] > 0
    for r in rows:
        low, high = sorted(x["tok_s"] for x in record["runs"] if x["slots"] == r["slots"])
        assert r["tok_s"] == low and r["tok_s_range"] == f"{low:.1f}-{high:.1f}"
    assert rows[0]["speedup"] == 1.0
    assert (tmp_path / "serve.png").stat().st_size > 0


def run(spec: str, slots: int, tok_s: float, errors: int = 0) -> Row:
    return Row(slots, spec, "x", 4, 100, 1.0, tok_s, 0.5, errors, first_error="e" * errors)


def test_medians_take_the_middle_run_and_add_up_errors() -> None:
    runs = [run("on", 1, 10.0), run("on", 4, 40.0), run("on", 4, 20.0, errors=1)]
    runs += [run("on", 1, 12.0), run("on", 1, 8.0), run("on", 4, 30.0)]
    one, four = medians(runs)
    assert (one.slots, one.tok_s, one.runs, one.tok_s_range) == (1, 10.0, 3, "8.0-12.0")
    assert (four.tok_s, four.errors, four.first_error) == (30.0, 1, "e")
    assert four.speedup == 3.0


def test_run_order_interleaves_rounds() -> None:
    order = run_order(["on", "off"], [4, 1], 3)
    once = [("on", 1), ("on", 4), ("off", 1), ("off", 4)]
    assert order == once + once[::-1] + once


@pytest.mark.parametrize(
    "rss, flat",
    [
        ([1000, 1200, 1210, 1215], True),  # growth before the first loaded sample is allowed
        ([1000, 1200, 1250, 1300], False),  # +100 MiB after it: more than max(2 %, 32 MiB)
        ([1000, 1000 + FLAT_MIB], None),  # start and end only: not judged
    ],
    ids=["warm-up-growth-then-flat", "steady-growth", "too-few-samples"],
)
def test_rss_flatness(rss: list[float], flat: bool | None) -> None:
    samples = [Sample(30.0 * i, r, 10 * i) for i, r in enumerate(rss)]
    assert judge_flat(samples).flat is flat


def test_bench_serve_load_with_a_hostile_client(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short load run with one hostile client: the normal clients' answers equal the
    quiet pass's, and every bad request got an allowed status."""
    argv = ["bench", "serve", "--model", str(tiny_folder), "--dtype", "float64"]
    argv += ["--device", "cpu", "--threads", "1", "--load", "--duration", "4"]
    argv += ["--sample-every", "1", "--clients", "2", "--max-tokens", "8", "--hostile", "1"]
    assert main([*argv, "--in-process", "--out", str(tmp_path / "load")]) == 0
    out = capsys.readouterr().out
    normal = next(line for line in out.splitlines() if line.startswith("normal clients:"))
    done = int(normal.split(" of ")[1].split()[0])
    assert done > 0 and normal.startswith(f"normal clients: {done} of {done} answers equal")
    assert "0 errors" in normal
    hostile = next(line for line in out.splitlines() if line.startswith("hostile clients:"))
    assert "; 0 answered outside their allowed statuses" in hostile
    assert int(hostile.split()[2]) >= 3  # one bad request a second
    record = json.loads((tmp_path / "load.json").read_text())["hostile"]
    assert record["answers"] == done and record["different"] == record["wrong"] == []
