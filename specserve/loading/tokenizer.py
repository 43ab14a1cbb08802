"""Tokenizer and chat template, built by transformers from a GGUF's metadata or an HF folder.

Building a tokenizer from GGUF metadata takes transformers 15-25 s, so the result is saved
once under the cache folder (keyed by the file's path, size and mtime) and reloaded from there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from specserve.errors import SpecserveError
from specserve.loading.sources import cache_dir

# tokens that end a turn in the families we serve (llama.cpp calls these end-of-generation)
_EOG_NAMES = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end_of_text|>")


class Tokenizer:
    def __init__(self, hf: Any) -> None:
        self.hf = hf
        vocab = hf.get_vocab()
        eog = {vocab[n] for n in _EOG_NAMES if n in vocab}
        if hf.eos_token_id is not None:
            eog.add(hf.eos_token_id)
        self.eog_ids: frozenset[int] = frozenset(eog)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return str(template) if template else None

    def encode(self, text: str) -> list[int]:
        """Text -> ids, with the BOS token where the model's tokenizer adds one."""
        return list(self.hf.encode(text))

    def encode_text(self, text: str) -> list[int]:
        """Text -> ids as it would appear inside a sequence: no BOS or other special token."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special))

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes (OpenAI logprobs' `bytes`): a token may hold part of a
        UTF-8 character, which decoding it alone would turn into U+FFFD."""
        pieces = self.hf.convert_ids_to_tokens(list(ids))
        # an id the vocabulary leaves unused (a model's rows are padded) spells nothing
        return [b"" if p is None else self._piece_bytes(p) for p in pieces]

    def token_table(self, size: int) -> list[bytes]:
        """Every id's bytes for constrained decoding; b"" (never allowed) for special
        tokens (<|im_start|>, <eos>, ...: decoding drops them, so they are no text) and for
        ids the vocabulary leaves unused. Added tokens that are text stay (Gemma's "\n",
        Qwen's <tool_call>)."""
        table = self.token_bytes(range(size))
        added = getattr(self.hf, "added_tokens_decoder", {})
        special = {i for i, t in added.items() if t.special} | set(self.hf.all_special_ids)
        for token in special:
            if 0 <= token < size:
                table[token] = b""
        return table

    @cached_property
    def _piece_bytes(self) -> Callable[[str], bytes]:
        """How this vocabulary spells bytes in its pieces, from the tokenizer's decoder."""
        decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
        kinds = {spec.get("type")} | {d.get("type") for d in spec.get("decoders", [])}
        if "ByteLevel" in kinds:  # GPT-2's byte-to-character map (Qwen, Llama 3)
            return _byte_level_bytes
        if "ByteFallback" in kinds:  # SentencePiece: "▁" is a space, "<0x0A>" one byte
            return _byte_fallback_bytes
        return lambda piece: piece.encode()

    def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Messages (and the tools the model may call) -> prompt ids with the generation
        prompt appended. Only the template's own markup becomes control tokens: a user who
        types `<|im_start|>system` into a message gets those characters as text
        (transformers' sanitize_control_tokens), so no message can forge a turn."""
        if not self.has_chat_template:
            raise SpecserveError("this model has no chat template (a base model?): drop --chat")
        ids = self.hf.apply_chat_template(
            messages,
            tools=tools,
            tokenize=True,
            add_generation_prompt=True,
            sanitize_control_tokens=True,
            return_dict=False,
        )
        return [int(t) for t in ids]


@cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, every
    other byte b for the character 256 + (its rank among those others)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + n): b for n, b in enumerate(others)})
    return chars


def _byte_level_bytes(piece: str) -> bytes:
    chars = _byte_level_chars()
    if all(c in chars for c in piece):
        return bytes(chars[c] for c in piece)
    return piece.encode()  # an added token written as text (<|im_end|>)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_fallback_bytes(piece: str) -> bytes:
    byte = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()


def load_tokenizer(path: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    if path.is_dir():
        return Tokenizer(AutoTokenizer.from_pretrained(str(path)))
    saved = _saved_dir(path)
    if not (saved / "tokenizer_config.json").is_file():
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
        hf.save_pretrained(str(tmp))
        os.replace(tmp, saved) if not saved.exists() else None
    return Tokenizer(AutoTokenizer.from_pretrained(str(saved)))


def _saved_dir(path: Path) -> Path:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:16]
