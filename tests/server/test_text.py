"""TextStream: incremental detokenization and stop strings, with a byte-level fake tokenizer."""

from __future__ import annotations

import pytest

from specserve.server.text import TextStream


def decode(ids: list[int]) -> str:
    """Each id is one byte, as byte-level BPE tokenizers split multi-byte characters."""
    return bytes(ids).decode("utf-8", errors="replace")


def ids(text: str) -> list[int]:
    return list(text.encode())


def run(pieces: list[str], stop: list[str]) -> tuple[list[str], bool]:
    """Push each piece's bytes one id at a time; the deltas emitted, and whether it stopped."""
    stream = TextStream(decode, stop)
    out = [stream.push([b]) for piece in pieces for b in ids(piece)]
    out.append(stream.flush())
    return [d for d in out if d], stream.stopped


def test_deltas_join_to_the_whole_text_and_never_split_a_character() -> None:
    deltas, stopped = run(["héllo ", "wörld ✓"], [])
    assert "".join(deltas) == "héllo wörld ✓" and not stopped
    assert all("\ufffd" not in d for d in deltas)


CASES = {
    "stop-inside-one-piece": (["one two three"], ["two"], "one "),
    "stop-across-pieces": (["Hi\n", "\nthere"], ["\n\n"], "Hi"),
    "earliest-of-several": (["a-b+c"], ["+", "-"], "a"),
    "partial-match-released-at-the-end": (["abc\n"], ["\n\n"], "abc\n"),
    "stop-at-the-very-start": (["STOP here"], ["STOP"], ""),
    "empty-stop-string-ignored": (["abc"], [""], "abc"),
}


@pytest.mark.parametrize("pieces, stop, expected", CASES.values(), ids=CASES.keys())
def test_stop_strings(pieces: list[str], stop: list[str], expected: str) -> None:
    deltas, stopped = run(pieces, stop)
    assert "".join(deltas) == expected
    assert stopped == (expected != "".join(pieces))


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    stream = TextStream(decode, ["END"])
    assert stream.push(ids("abcE")) == "abc"  # "E" may begin "END"
    assert stream.push(ids("N")) == ""
    assert stream.push(ids("x")) == "ENx"  # it did not
    assert stream.push(ids("END more")) == "" and stream.stopped
    assert stream.push(ids("ignored")) == "" and stream.flush() == ""
    assert stream.n_tokens == len(ids("abcENxEND more"))


def test_push_each_stops_at_the_id_that_completes_the_stop_string() -> None:
    stream = TextStream(decode, ["c|"])
    assert stream.push_each(ids("ab")) == ("ab", 2)
    assert stream.push_each(ids("c|de")) == ("", 2)  # "c|" found: d and e are not taken
    assert stream.stopped and stream.n_tokens == 4


def _partial_prefix_reference(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@pytest.mark.parametrize("seed", range(30))
def test_partial_prefix_equals_the_readable_rule(seed: int) -> None:
    import random

    from specserve.server.text import partial_prefix

    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
        marker = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 8)))
        assert partial_prefix(text, marker) == _partial_prefix_reference(text, marker)
