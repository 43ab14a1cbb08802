"""Token bytes (logprobs' `bytes`): each vocabulary's spelling of bytes read back exactly."""

from __future__ import annotations

from specserve.loading.tokenizer import _byte_fallback_bytes, _byte_level_bytes, _byte_level_chars


def test_byte_level_alphabet_is_a_bijection_over_all_bytes() -> None:
    chars = _byte_level_chars()
    assert sorted(chars.values()) == list(range(256))
    assert chars["A"] == 65 and chars["\u0120"] == 32  # "Ġ" is the space


def test_byte_level_pieces_give_their_bytes_even_half_a_character() -> None:
    spell = {b: c for c, b in _byte_level_chars().items()}
    text = " héllo ✓\n".encode()
    piece = "".join(spell[b] for b in text)
    assert _byte_level_bytes(piece) == text
    assert _byte_level_bytes(piece[-3:]) == text[-3:]  # the tail of "✓" and the newline
    assert _byte_level_bytes("<|im_end|>") == b"<|im_end|>"


def test_byte_fallback_pieces() -> None:
    assert _byte_fallback_bytes("\u2581world") == b" world"
    assert _byte_fallback_bytes("<0x0A>") == b"\n"
    assert _byte_fallback_bytes("<0xE2>") == b"\xe2"  # one byte of a character
    assert _byte_fallback_bytes("<end_of_turn>") == b"<end_of_turn>"


def test_token_table_leaves_special_tokens_out(tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    from specserve.loading.tokenizer import Tokenizer
    from tests.tiny import VOCAB, write_tokenizer

    write_tokenizer(tmp_path)
    table = Tokenizer(AutoTokenizer.from_pretrained(str(tmp_path))).token_table(VOCAB)
    assert table[0] == table[1] == b""  # <unk>, <|endoftext|>: decoding drops them
    assert table[ord("A")] == b"A" and table[ord("{")] == b"{"
    assert table[5] == b""  # an id the vocabulary does not use
