"""`specserve bench serve --sessions` end to end on the tiny model: the prompt store on and
off, over more sessions than slots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.bench import session_load
from specserve.bench.session_load import Shape, run_sessions, tool_output
from specserve.cli import main
from tests.server.conftest import MODEL_ID, LiveServer


def test_bench_sessions_caches_returning_turns_only_with_the_store(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "serve", "--model", str(tiny_folder), "--dtype", "float64"]
    argv += ["--device", "cpu", "--threads", "1", "--slots", "1", "--spec", "off"]
    argv += ["--sessions", "3", "--turns", "2", "--turn-words", "4", "--max-tokens", "4"]
    argv += ["--cache-ram", "16", "--repeats", "1", "--in-process", "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TTFT turns 2+ s" in out and "least cached" in out
    rows = {r["store"]: r for r in json.loads((tmp_path / "s.json").read_text())["rows"]}
    on, off = rows["on"], rows["off"]
    for r in (on, off):
        assert (r["requests"], r["errors"]) == (6, 0)
        assert all(t["ttft_s"] > 0 and t["prompt_tokens"] > 0 for t in r["turns"])
    # one slot, three sessions: without the store a returning turn finds at most the shared
    # system prompt; with it, its whole history (turn 1's prompt and answer)
    for r, back in ((on, True), (off, False)):
        first = {t["session"]: t["prompt_tokens"] for t in r["turns"] if t["turn"] == 1}
        for t in (t for t in r["turns"] if t["turn"] == 2):
            assert (t["cached_tokens"] > first[t["session"]]) == back, (r["store"], t)
    assert on["cached_min"] > off["cached_min"]
    assert 0 < on["store_mib"] <= on["budget_mib"] == 16
    assert off["budget_mib"] == 0


def test_tool_outputs_are_deterministic_and_differ_by_session() -> None:
    assert tool_output(1, 2, 50) == tool_output(1, 2, 50)
    assert tool_output(1, 2, 50) != tool_output(2, 2, 50)
    assert len(tool_output(0, 1, 50).split()) >= 50


def test_a_bad_llama_server_fails_before_any_row_runs(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "serve", "--model", str(tiny_folder), "--sessions", "2", "--in-process"]
    assert main([*argv, "--llama-server", str(tmp_path / "missing")]) != 0
    assert "no llama-server at" in capsys.readouterr().err
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert main([*argv, "--llama-server", str(exe)]) != 0  # the tiny model is no GGUF
    err = capsys.readouterr().err
    assert "needs a GGUF model" in err and "store on" not in err


@pytest.mark.parametrize("order", ["client", "shared"])
def test_every_session_takes_its_turns_in_order_whoever_sends_them(
    live: LiveServer, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_load, "MODEL_ID", MODEL_ID)  # the name the live server serves
    shape = Shape(sessions=5, turns=3, clients=2, max_tokens=3, words=4, order=order)
    turns = run_sessions(live.url, shape)
    assert [t.error for t in turns if t.error] == []
    assert sorted((t.session, t.turn) for t in turns) == [
        (s, n) for s in range(5) for n in range(1, 4)
    ]
    for s in range(5):  # a returning turn re-sends the history: its prompt only grows
        mine = [t for t in turns if t.session == s]
        assert [t.turn for t in mine] == [1, 2, 3]
        assert mine[0].prompt_tokens < mine[1].prompt_tokens < mine[2].prompt_tokens
