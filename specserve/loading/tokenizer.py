"""Tokenizer and chat template, built by transformers from a GGUF's metadata or an HF folder.

Building a tokenizer from GGUF metadata takes transformers 15-25 s, so the result is saved
once under the cache folder (keyed by the file's path, size and mtime) and reloaded from there.
"""

from __future__ import annotations

import hashlib
import os
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
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Text -> ids, with the BOS token where the model's tokenizer adds one."""
        return list(self.hf.encode(text))

    def encode_text(self, text: str) -> list[int]:
        """Text -> ids as it would appear inside a sequence: no BOS or other special token."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special))

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Messages -> prompt ids with the generation prompt appended."""
        if not self.has_chat_template:
            raise SpecserveError("this model has no chat template (a base model?): drop --chat")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # the template writes special tokens as text (BOS included), so add none here
        return self.encode_text(text)


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
