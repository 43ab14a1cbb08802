"""`specserve serve` flags: names, defaults, and the errors they can end in."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

import pytest

from specserve.errors import SpecserveError
from specserve.server.cli_args import add_serve_args, build_server
from specserve.speculative.registry import parse_types


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_flags_and_defaults() -> None:
    args = parse("--model", "m", "-np", "2", "--ctx-size", "64", "--spec-type", "suffix, draft,")
    assert (args.parallel, args.ctx_size) == (2, 64)
    assert parse_types(args.spec_type) == ["suffix", "draft"]
    assert (args.host, args.port, args.max_queue, args.dtype) == ("127.0.0.1", 8080, 64, "float32")
    assert (args.draft_max, args.draft_min, args.draft_p_min) == (16, 0, 0.75)
    assert args.draft_alternatives == 2
    assert parse("--draft-alternatives", "0").draft_alternatives == 0
    assert parse_types(parse().spec_default) == ["ngram-map-k", "suffix", "prediction"]
    assert parse().model == "qwen2.5-coder-0.5b"
    with pytest.raises(SpecserveError, match="unknown speculative type"):
        parse_types("ngram-nope")


def test_the_model_loads_on_the_thread_that_steps_it(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one OpenMP team per process (engine/threads.py ComputeThread)
    from specserve.server import cli_args

    loaded_on = []
    original = cli_args.build_engine

    def build(*a: Any, **k: Any) -> Any:
        loaded_on.append(threading.get_ident())
        return original(*a, **k)

    monkeypatch.setattr(cli_args, "build_engine", build)
    loop, _, _ = build_server(parse("--model", str(tiny_folder), "--device", "cpu", "-c", "64"))
    assert loaded_on and loaded_on[0] != threading.get_ident()
    assert loop.compute.call(threading.get_ident) == loaded_on[0]
    loop.start()
    assert loop.alive
    loop.stop(5)
    assert not loop.alive


def test_built_server_follows_the_flags(tiny_folder: Path) -> None:
    args = parse("--model", str(tiny_folder), "--alias", "t", "-np", "3", "-c", "128")
    args.device = "cpu"
    loop, cfg, _ = build_server(args)
    assert (loop.num_slots, loop.engine.runner.memory.max_len, cfg.model_id) == (3, 128, "t")
    assert loop.engine.speculator is not None
    assert cfg.spec_types == ("ngram-map-k", "suffix", "prediction") and cfg.webui
    argv = ("--model", str(tiny_folder), "--spec-type", "none", "--no-webui")
    loop, cfg, _ = build_server(parse(*argv))
    assert loop.engine.speculator is None and cfg.spec_defaults.n_max == 0 and not cfg.webui


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--spec-type", "draft"], "--spec-type draft needs --draft-model"),
        (["-np", "0"], "parallel slots \\(-np\\) must be >= 1"),
        (["--max-queue", "-1"], "--max-queue must be >= 0"),
        (["--cache-ram", "-1"], "--cache-ram must be >= 0"),
    ],
    ids=["draft-without-model", "no-slots", "negative-queue", "negative-cache-ram"],
)
def test_bad_flags_are_clear_errors(tiny_folder: Path, argv: list[str], message: str) -> None:
    args = parse("--model", str(tiny_folder), "--device", "cpu", "-c", "64", *argv)
    with pytest.raises(SpecserveError, match=message):
        build_server(args)


def test_cache_ram_sizes_the_prompt_store(tiny_folder: Path) -> None:
    base = ("--model", str(tiny_folder), "--device", "cpu", "-c", "64", "--spec-type", "none")

    def budget(*argv: str) -> int | None:
        loop, _, _ = build_server(parse(*base, *argv))
        loop.compute.close()
        store = loop.engine.prompts.store
        return None if store is None else store.budget

    assert budget("--cache-ram", "12.5") == int(12.5 * 2**20)
    assert budget("--cache-ram", "0") is None
    assert 0 < (budget() or 0) <= 8 * 2**30  # default: from available memory, capped
    assert budget("--no-cache-prompt") is None  # no prompt reuse: nothing to store for


def test_bad_draft_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="draft-min <= draft-max"):
        build_server(parse("--model", "unused", "--draft-max", "2", "--draft-min", "3"))
