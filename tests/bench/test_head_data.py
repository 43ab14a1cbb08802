"""bench/head_data.py: the prompts a head's answers are made from, the answers held out,
and the standard library's source as training text."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from specserve.bench import head_data, train_head


def test_the_prompts_take_python_its_programs_other_languages_and_prose_in_turn() -> None:
    asks = head_data.asks(30, seed=0)
    assert len(set(asks)) == 30
    prose = [a for a in asks if any(t in a for t in head_data.PROSE_TOPICS)]
    other = [a for a in asks if any(f" {g} " in a for g in head_data.LANGUAGES)]
    programs = set(head_data.code_asks(["Python"], head_data.python_topics()))
    assert len(prose) == len(other) == 7  # and the rest, Python
    assert set(asks[1::4]) <= programs and len(asks[1::4]) == 8  # every fourth ask
    # Python programs about the standard library's modules, not only about TOPICS
    assert len(programs) > 3 * len(head_data.code_asks(["Python"]))
    assert head_data.asks(30, seed=0) == asks != head_data.asks(30, seed=1)
    # an ask in two kinds is asked once
    everything = head_data.asks(10_000, seed=0)
    assert len(everything) == len(set(everything)) and programs <= set(everything)


def test_an_answer_held_out_once_is_held_out_in_every_list_that_has_it() -> None:
    """Held out by place, a resumed head was measured on answers an earlier run, whose asks
    came in another order, had trained on. By the prompt's hash, never."""
    import random

    own = [([i, i + 1, 7], [i % 5, 3]) for i in range(600)]
    shuffled = random.Random(1).sample(own, 400)
    held, trained = head_data.split_answers(own)
    held2, trained2 = head_data.split_answers(shuffled)
    never = {tuple(p) for p, _ in own} - {tuple(p) for p, _ in trained}
    assert 0 < len(held) <= head_data.HELD_OUT // 2 and len(never) > len(held)  # 600 / 16
    assert not never & {tuple(p) for p, _ in trained2}
    assert {tuple(p) for p, _ in held2} <= never
    assert head_data.split_answers(own[:1]) == (own[:1], [])  # too few to draw: the first


def test_stdlib_text_comes_in_pieces_up_to_the_cap_and_a_larger_cap_extends_it() -> None:
    # a byte per token: every piece is seq_len long, and the files come in a seeded order
    loaded = SimpleNamespace(tokenizer=SimpleNamespace(encode_text=lambda s: list(s.encode())))
    small = head_data.stdlib_chunks(loaded, 50_000, 64, seed=0)  # type: ignore[arg-type]
    large = head_data.stdlib_chunks(loaded, 200_000, 64, seed=0)  # type: ignore[arg-type]
    assert small and all(len(piece) == 64 for piece in large)
    assert 50_000 <= 64 * len(small) < 64 * len(large) and 64 * len(large) >= 200_000
    # a resumed run given more of the text first sees what the earlier run saw
    assert large[: len(small)] == small
    assert head_data.stdlib_chunks(loaded, 50_000, 64, seed=1) != small  # type: ignore[arg-type]


def test_train_head_takes_the_stdlib_cap_from_its_flag() -> None:
    import argparse

    p = argparse.ArgumentParser()
    train_head.add_args(p)
    assert p.parse_args(["--model", "m"]).stdlib_tokens == head_data.STDLIB_TOKENS
    assert p.parse_args(["--model", "m", "--stdlib-tokens", "5000"]).stdlib_tokens == 5000


def test_a_reply_ends_at_its_first_end_of_turn_even_in_a_file_cached_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file written before replies stopped there holds them decoded on to max_tokens."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    assert head_data.until_stop([5, 6, 2, 7, 9, 8], frozenset({2, 9})) == [5, 6, 2]
    assert head_data.until_stop([5, 6], frozenset({2})) == [5, 6]
    path = head_data._answers_path("m", head_data.asks(2, 0), 8, 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps([[[1], [4, 2, 5, 5]], [[3], [4, 4]]]))
    loaded = SimpleNamespace(tokenizer=SimpleNamespace(eog_ids=frozenset({2})))
    got = head_data.cached_answers(loaded, "m", 2, 8, 0)  # type: ignore[arg-type]
    assert got == [([1], [4, 2]), ([3], [4, 4])]


def test_a_longer_cap_reads_whole_replies_back_and_decodes_cut_ones_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answers cached at max_tokens 4: one ended at its end of turn, one its cap cut. Asked
    for 6, the first is read back as it is and only the second is decoded, from where it was
    cut, for the 2 tokens left."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    questions = head_data.asks(3, 0)
    prompts = [[ord(c) for c in q] for q in questions]
    short = head_data._answers_path("m", questions[:2], 4, 0)
    short.parent.mkdir(parents=True)
    short.write_text(json.dumps([[prompts[0], [7, 2]], [prompts[1], [7, 8, 9, 10]]]))
    decoded = []

    def fake(loaded, asked, max_tokens, stop_ids):  # noqa: ANN001, ANN202
        decoded.append((asked, max_tokens))
        return [(p, [11] * max_tokens) for p in asked]

    monkeypatch.setattr(head_data, "answers", fake)
    chat = SimpleNamespace(chat=lambda m: [ord(c) for c in m[0]["content"]], eog_ids=frozenset({2}))
    got = head_data.cached_answers(SimpleNamespace(tokenizer=chat), "m", 3, 6, 0)  # type: ignore[arg-type]
    whole, continued = (prompts[0], [7, 2]), (prompts[1], [7, 8, 9, 10, 11, 11])
    assert got == [whole, continued, (prompts[2], [11] * 6)]
    assert decoded == [([prompts[1] + [7, 8, 9, 10]], 2), ([prompts[2]], 6)]
    # a cap as long as the cached one's, or shorter, takes nothing from it
    assert head_data._shorter_answers("m", 4, frozenset({2}), {}) == {}
