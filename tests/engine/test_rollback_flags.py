"""--rollback and --spec-type mtp from the command line: generate and serve build the engine
they describe, and greedy output stays the plain output with either strategy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from specserve.cli import main
from specserve.errors import SpecserveError
from specserve.server.cli_args import add_serve_args, build_server
from tests.tiny import write_tokenizer
from tests.tiny_hybrid import write_hybrid_folder


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory) -> Path:  # noqa: ANN001
    folder = tmp_path_factory.mktemp("tiny-qwen3_5")
    write_hybrid_folder("qwen3_5", folder, seed=1)
    write_tokenizer(folder)
    return folder


def _generate(folder: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> list[int]:
    argv = ["generate", "--model", str(folder), "--prompt", "abcabcabc", "--json"]
    argv += ["--max-tokens", "40", "--dtype", "float64", "--device", "cpu", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["tokens"]


@pytest.mark.parametrize("rollback", ["snapshots", "checkpoint", "auto"])
def test_generate_with_mtp_gives_the_plain_output(
    rollback: str, hybrid_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = _generate(hybrid_folder, capsys)
    spec = ["--spec-type", "mtp,ngram-mod", "--draft-p-min", "0", "--rollback", rollback]
    assert _generate(hybrid_folder, capsys, *spec) == plain


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_serve_follows_the_rollback_flags(hybrid_folder: Path) -> None:
    args = _serve_args("--model", str(hybrid_folder), "--device", "cpu", "-c", "64")
    args.spec_type, args.rollback, args.draft_max = "mtp", "snapshots", 6
    loop, cfg, _ = build_server(args)
    policy = loop.engine.runner.policy
    assert (policy.strategy, policy.depth) == ("snapshots", 7)  # n_rs_seq = draft max + 1
    assert cfg.spec_types == ("mtp",)
    assert _serve_args().rollback == "auto"
    with pytest.raises(SystemExit):
        _serve_args("--rollback", "sometimes")


def test_mtp_without_mtp_weights_is_a_clear_error(tmp_path: Path) -> None:
    write_hybrid_folder("qwen3_5", tmp_path, seed=1, mtp=False)
    args = _serve_args("--model", str(tmp_path), "--device", "cpu", "-c", "64")
    args.spec_type = "mtp"
    with pytest.raises(SpecserveError, match="multi-token-prediction"):
        build_server(args)
