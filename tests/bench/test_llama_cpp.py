"""`bench decode --llama-bench`: llama-bench's JSON turned into our columns, and a failing or
missing llama-bench reported as an error (a fake llama-bench script stands in for the real
one, which no package ships)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from specserve.bench.llama_cpp import llama_bench_row, row_from_results, run_llama_bench
from specserve.errors import SpecserveError


def _test(n_prompt: int, n_gen: int, n_depth: int, ms: list[float]) -> dict:
    return {
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_depth": n_depth,
        "samples_ns": [m * 1e6 for m in ms],
    }


def test_row_from_results_uses_medians_and_the_depth_tests() -> None:
    results = [
        _test(256, 0, 0, [1000, 2000, 1280]),  # prefill: median 1.28 s
        _test(1, 0, 256, [30, 25, 20]),  # k=1 median 25 ms
        _test(4, 0, 256, [50, 55, 60]),
        _test(8, 0, 256, [100, 95, 90]),
        _test(8, 0, 0, [1, 1, 1]),  # not at depth: ignored for k
        _test(0, 64, 256, [2000, 3200, 2100]),  # decode: median 2.1 s
    ]
    row = row_from_results(results, (1, 4, 8))
    assert row["prefill_tok_s"] == pytest.approx(200.0)
    assert row["decode_tok_s"] == pytest.approx(64 / 2.1)
    assert row["ms_k1"] == pytest.approx(25.0)
    assert row["k=1"] == 1.0
    assert row["k=4"] == pytest.approx(2.2)
    assert row["k=8"] == pytest.approx(3.8)


def test_row_from_results_names_a_missing_k() -> None:
    results = [_test(64, 0, 0, [1]), _test(1, 0, 64, [1]), _test(0, 8, 64, [1])]
    with pytest.raises(SpecserveError, match=r"k = \[2\]"):
        row_from_results(results, (1, 2))


def _fake(tmp_path: Path, body: str) -> Path:
    exe = tmp_path / "llama-bench"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_a_fake_llama_bench_gives_a_row_and_sees_our_arguments(tmp_path: Path) -> None:
    # answers each call from its arguments: -d present -> the k and decode tests
    tests_0 = [_test(32, 0, 0, [100])]
    tests_d = [_test(k, 0, 32, [10 * k]) for k in (1, 2)] + [_test(0, 4, 32, [400])]
    log = tmp_path / "args.txt"
    script = (
        f'echo "$@" >> {log}\n'
        'case "$*" in\n'
        f"  *-d*) echo '{json.dumps(tests_d)}' ;;\n"
        f"  *) echo '{json.dumps(tests_0)}' ;;\n"
        "esac\n"
    )
    exe = _fake(tmp_path, script)
    row = llama_bench_row(exe, Path("m.gguf"), 2, 32, 4, 3, (1, 2))
    assert row["prefill_tok_s"] == pytest.approx(320.0)
    assert row["decode_tok_s"] == pytest.approx(10.0)
    assert row["k=2"] == pytest.approx(2.0)
    assert row["peak_rss_mb"] >= 0
    calls = log.read_text().splitlines()
    assert calls[0] == "-m m.gguf -r 3 -t 2 -p 32 -n 0 -o json"
    assert calls[1] == "-m m.gguf -r 3 -t 2 -p 1,2 -n 4 -d 32 -o json"


def test_a_failing_llama_bench_is_a_clear_error(tmp_path: Path) -> None:
    exe = _fake(tmp_path, "echo 'error: failed to load model' >&2\nexit 1\n")
    with pytest.raises(SpecserveError, match="llama-bench failed.*failed to load model"):
        run_llama_bench(exe, ["-m", "x.gguf"])


def test_a_missing_llama_bench_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecserveError, match="cannot run llama-bench"):
        run_llama_bench(tmp_path / "nope", [])
