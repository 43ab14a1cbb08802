"""bench quality's prompts: the chat template where the model has one, plain text otherwise."""

from __future__ import annotations

from typing import Any

from specserve.bench.quality import prompt_ids


class _Tok:
    def __init__(self, template: bool) -> None:
        self.has_chat_template = template

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return [1, *self.encode(messages[0]["content"]), 2]

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_a_base_model_gets_the_plain_text() -> None:
    # Gemma 3 270M has no chat template: the benchmark stopped with "drop --chat"
    assert prompt_ids(_Tok(False), "ab") == [97, 98]  # type: ignore[arg-type]
    assert prompt_ids(_Tok(True), "ab") == [1, 97, 98, 2]  # type: ignore[arg-type]
