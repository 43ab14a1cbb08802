"""User errors end with one clear line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import write_hf_folder, write_tokenizer


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "specserve.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:  # noqa: ANN001
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    write_hf_folder("qwen2", folder, seed=1)
    write_tokenizer(folder)
    return folder


def _assert_clean_error(done: subprocess.CompletedProcess, message: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert message in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: ")


def test_unknown_model_name() -> None:
    done = _cli("generate", "--model", "no-such-model", "--prompt", "hi")
    _assert_clean_error(done, "unknown model name 'no-such-model'; known models:")


def test_missing_gguf_file(tmp_path: Path) -> None:
    done = _cli("generate", "--model", str(tmp_path / "gone.gguf"), "--prompt", "hi")
    _assert_clean_error(done, "model file not found")


@pytest.mark.parametrize(
    "content",
    [b"GGUF\x03\x00\x00\x00garbage", b"not a gguf at all", b""],
    ids=["truncated-header", "wrong-magic", "empty"],
)
def test_corrupt_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    done = _cli("generate", "--model", str(path), "--prompt", "hi")
    _assert_clean_error(done, "not a readable GGUF file")


def test_prompt_longer_than_context(tiny_folder: Path) -> None:
    done = _cli("generate", "--model", str(tiny_folder), "--prompt", "x" * 40, "--ctx-size", "16")
    _assert_clean_error(done, "the prompt has 40 tokens; the context holds 16")


def test_bad_sampling_setting(tiny_folder: Path) -> None:
    done = _cli("generate", "--model", str(tiny_folder), "--prompt", "hi", "--top-p", "1.5")
    _assert_clean_error(done, "top_p must be in (0, 1]")


def test_generate_json_and_seeded_sampling_is_reproducible(tiny_folder: Path) -> None:
    args = ["generate", "--model", str(tiny_folder), "--prompt", "hello", "--json"]
    args += ["--max-tokens", "12", "--temperature", "0.9", "--seed", "7"]
    first, second = _cli(*args), _cli(*args)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert set(out) >= {"text", "tokens", "prompt_tokens", "timings"}
    assert out["prompt_tokens"] == 5 and len(out["tokens"]) == 12
    assert out == {**json.loads(second.stdout), "timings": out["timings"]}
