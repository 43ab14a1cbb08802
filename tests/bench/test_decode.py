"""`bench decode`'s measurement on a tiny model: every column is there and sane, and the
runner's context is back where the k-token forwards need it."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.bench.decode import KS, measure
from specserve.cli import build_parser
from specserve.engine.runner import ModelRunner
from specserve.loading.model import load_model
from tests.tiny import device_under_test, write_hf_folder


def test_measure_gives_every_column(tmp_path: Path) -> None:
    write_hf_folder("qwen2", tmp_path)
    model = load_model(tmp_path, "float32", device=device_under_test()).model
    runner = ModelRunner(model, num_slots=1, max_len=64)
    row = measure(runner, prompt_len=20, decode_len=3, repeats=2)
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0 and row["ms_k1"] > 0
    assert row["k=1"] == 1.0
    assert all(row[f"k={k}"] > 0 for k in KS)
    # both decode passes started from the prompt's end, and the last k-token forward from the
    # end of one pass: the context holds the prompt, one pass and that forward
    assert runner.memory.length(0) == 20 + 3 + max(KS)


def test_device_flag() -> None:
    assert build_parser().parse_args(["bench", "decode"]).device == "cpu"
    assert build_parser().parse_args(["bench", "decode", "--device", "cuda"]).device == "cuda"


def test_llama_bench_flag(tmp_path: Path) -> None:
    args = build_parser().parse_args(["bench", "decode", "--llama-bench", str(tmp_path / "lb")])
    assert args.llama_bench == tmp_path / "lb"
    assert build_parser().parse_args(["bench", "decode"]).llama_bench is None


@pytest.mark.parametrize("flag", ["--decode-len", "--prompt-len", "--repeats", "--paired-rounds"])
def test_counts_below_one_are_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    # 0 decode tokens left llama-bench without a generation test (StopIteration)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "decode", flag, "0"])
    assert e.value.code == 2
    assert f"{flag}: must be at least 1, got 0" in capsys.readouterr().err
    assert (
        getattr(
            build_parser().parse_args(["bench", "decode", flag, "3"]), flag[2:].replace("-", "_")
        )
        == 3
    )


def test_llama_bench_needs_a_gguf(tmp_path: Path) -> None:
    from specserve.bench.decode import _llama_cpp_row
    from specserve.errors import SpecserveError

    write_hf_folder("qwen2", tmp_path)
    args = build_parser().parse_args(["bench", "decode", "--llama-bench", "lb"])
    with pytest.raises(SpecserveError, match="needs a GGUF model"):
        _llama_cpp_row(str(tmp_path), args)


def test_peak_rss_resets_between_rows() -> None:
    from specserve.bench.server_process import read_rss_mib, reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here")
    base = read_rss_mib("self", "VmHWM")
    big = bytearray(256 * 2**20)  # touched: bytearray zero-fills
    assert read_rss_mib("self", "VmHWM") >= base + 200
    del big
    assert reset_peak_rss()
    assert read_rss_mib("self", "VmHWM") < base + 100


@pytest.mark.parametrize(
    "flag", ["--repeats", "--clients", "--max-tokens", "--requests-per-client"]
)
def test_serve_counts_below_one_are_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    # the same argparse type as bench decode's: a message, exit code 2, no server started
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "serve", flag, "0"])
    assert e.value.code == 2
    assert f"{flag}: must be at least 1, got 0" in capsys.readouterr().err


def test_paired_rounds_alternate_with_llama_bench(tmp_path: Path) -> None:
    # a fake llama-bench at 10 tok/s; our tiny model is far faster: every round's ratio > 1,
    # the slot keeps its prompt, and each round ran one llama-bench decode of our shape
    import json
    import stat

    from specserve.bench.decode import _paired_row

    log, gguf = tmp_path / "args.txt", tmp_path / "m.gguf"
    exe = tmp_path / "llama-bench"
    gen = [{"n_prompt": 0, "n_gen": 3, "n_depth": 20, "samples_ns": [3e8]}]
    exe.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\necho '{json.dumps(gen)}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    write_hf_folder("qwen2", tmp_path / "hf")
    runner = ModelRunner(load_model(tmp_path / "hf", "float32").model, num_slots=1, max_len=64)
    measure(runner, prompt_len=20, decode_len=3, repeats=1)
    args = build_parser().parse_args(
        ["bench", "decode", "--llama-bench", str(exe), "--paired-rounds", "3", "--threads", "2"]
    )
    args.prompt_len, args.decode_len = 20, 3
    gguf.write_bytes(b"")
    row = _paired_row(str(gguf), "float32", runner, args)
    assert row["rounds"] == 3 and row["llama_cpp_decode_tok_s"] == pytest.approx(10.0)
    assert row["decode_tok_s"] > 10 and 1 < row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    calls = log.read_text().splitlines()
    assert calls == [f"-m {gguf} -r 1 -p 0 -n 3 -d 20 -t 2 -o json"] * 3
    assert runner.memory.length(0) == 20 + 3  # the prompt, then one pass


def test_paired_rounds_need_llama_bench() -> None:
    from specserve.bench.decode import main
    from specserve.errors import SpecserveError

    args = build_parser().parse_args(["bench", "decode", "--paired-rounds", "2"])
    with pytest.raises(SpecserveError, match="--paired-rounds needs --llama-bench"):
        main(args)
