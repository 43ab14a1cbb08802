"""The JSON-object recognizer against Python's json module: what it completes is exactly
what json.loads reads as an object, and every prefix of such a document stays alive."""

from __future__ import annotations

import json
import random

import pytest

from specserve.engine.json_grammar import START, advance, done

VALID = [
    "{}",
    '{"a":1}',
    '{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "days": [1, 2.5, -3e+2]}\n}',
    '{"s":"tab\\t quote\\" slash\\/ \\u00e9\\uD83D\\uDE00","t":true,"f":false,"n":null}',
    '{"nested":[[],{},[{"x":[0, -0.0, 12E-3]}]],"é✓":"日本語"}',
]
INVALID = [
    "[1]",  # JSON mode answers an object
    ' {"a":1}',  # the object starts at once
    '{"a" 1}',
    '{"a":01}',
    '{"a":-}',
    '{"a":1.}',
    '{"a":.5}',
    '{"a":tru}',
    '{"a":"x\\q"}',
    '{"a":"\x01"}',
    '{"a":"\\u12G4"}',
    "{,}",
    '{"a":1,}',
    '{"a":[1,]}',
    "{'a':1}",
    '{"a":1}}',
    '{"a":1} ',  # nothing follows the object
    '{"a":NaN}',
]


def _alive(text: str) -> bool:
    return advance(START, text.encode()) is not None


@pytest.mark.parametrize("doc", VALID)
def test_valid_objects_complete_and_every_prefix_lives(doc: str) -> None:
    data = doc.encode()
    assert done(advance(START, data))  # type: ignore[arg-type]
    for n in range(len(data)):
        state = advance(START, data[:n])
        assert state is not None and not done(state), data[:n]


@pytest.mark.parametrize("doc", INVALID)
def test_invalid_documents_die_or_stay_incomplete(doc: str) -> None:
    state = advance(START, doc.encode())
    assert state is None or not done(state)


def _loads_object(text: str) -> bool:
    def no_constants(name: str) -> None:
        raise ValueError(name)

    try:
        value = json.loads(text, parse_constant=no_constants)
    except ValueError:
        return False
    return isinstance(value, dict)


def test_agrees_with_json_loads_on_mutated_documents() -> None:
    """Random edits of valid documents: complete exactly when json.loads reads an object
    (and the text has no whitespace around it, which JSON mode does not emit)."""
    rng = random.Random(0)
    alphabet = list('{}[]",:\\ -+.0123456789eEtrufalsn\tx\u00e9')
    checked = 0
    for _ in range(3000):
        text = list(rng.choice(VALID))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) + 1)
            op = rng.random()
            if op < 0.4 and text:
                del text[min(i, len(text) - 1)]
            elif op < 0.8:
                text.insert(i, rng.choice(alphabet))
            elif text:
                text[min(i, len(text) - 1)] = rng.choice(alphabet)
        doc = "".join(text)
        if doc != doc.strip():
            continue
        state = advance(START, doc.encode())
        assert (state is not None and done(state)) == _loads_object(doc), doc
        checked += 1
    assert checked > 2000


def test_whitespace_runs_are_bounded() -> None:
    assert _alive('{"a":' + " " * 24)
    assert not _alive('{"a":' + " " * 25)
    assert _alive('{"a":' + " " * 24 + "1," + "\n" * 24)
