"""tool_choice "auto": free text stays free, and a reply that opens a call (a bare `{`, a
```json fence or a tagged block) is held to the offered tools' schemas from there on.
Checked on the grammar itself, over the char tokenizer."""

from __future__ import annotations

import pytest

from specserve.grammar.constraint import build_constraint
from specserve.grammar.formats import tool_calls
from tests.server.test_structured import CITY, CLOCK
from tests.tiny import VOCAB, char_tokenizer

GOOD = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def allowed(text: str) -> int:
    """How many characters of `text` the auto grammar takes from the reply's start."""
    grammar = tool_calls([CITY, CLOCK], "auto", parallel=True, tags_are_tokens=False)
    tok = char_tokenizer()
    return build_constraint(tok, VOCAB, grammar).valid_prefix(tok.encode_text(text))


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny in Paris.",
        "```python print('fences of code stay free')```",
        "``",
        f"```json {GOOD} ```",
        f"```json{GOOD}```",
        GOOD,
        f"Let me look. <tool_call>{GOOD}</tool_call>",
    ],
)
def test_free_text_and_valid_calls_are_taken_whole(text: str) -> None:
    assert allowed(text) == len(text)


@pytest.mark.parametrize(
    ("text", "refused_at"),
    [
        ('```json {"name": "rm"', '```json {"name": "'),  # no such tool
        ('```json {"name": "get_weather", "arguments": {"city": "Oslo', '{"city": "'),
        ('{"name": "get_weather", "arguments": {"town"', '"arguments": {"'),
        (f"```json {GOOD} and more", f"```json {GOOD} "),  # a fenced call is the whole reply
    ],
)
def test_a_begun_call_follows_the_schemas(text: str, refused_at: str) -> None:
    n = allowed(text)
    assert n < len(text) and text[:n].endswith(refused_at), text[:n]
