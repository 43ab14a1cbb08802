"""Our tokenizer as llguidance sees it: built once per tokenizer (it walks the whole
vocabulary), and for the model's row count, which may exceed the tokenizer's ids."""

from __future__ import annotations

import threading
from typing import Any

import llguidance

from specserve.loading.tokenizer import Tokenizer

# keyed by the HF tokenizer's identity; the value holds that tokenizer too, so the id is
# never reused by another while its entry lives
_built: dict[tuple[int, int], tuple[Any, llguidance.LLTokenizer]] = {}
_lock = threading.Lock()


def grammar_vocab(tok: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of `tok` with `vocab_size` ids; every end-of-generation id
    of ours ends a grammar's output."""
    key = (id(tok.hf), vocab_size)
    with _lock:  # two first requests at once build it once
        if key not in _built:
            _built[key] = (tok.hf, _build(tok, vocab_size))
        return _built[key][1]


def _build(tok: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """From each id's bytes as we decode them, not from the library's own reading of the
    HF tokenizer: that read a character-level tokenizer's "{" as a special token, and one
    table of bytes serves every tokenizer the same way."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Pieces(tok, vocab_size)))


class _Pieces:
    """What llguidance's TokenizerWrapper reads: each id's bytes, the special ids, and
    text -> ids. Special are the tokenizer's own and added tags such as `<tool_call>`, so a
    grammar can name them and free text never produces them."""

    def __init__(self, tok: Tokenizer, vocab_size: int) -> None:
        hf = tok.hf
        added = getattr(hf, "added_tokens_decoder", {})
        tags = {i for i, t in added.items() if t.special or _is_tag(str(t.content))}
        self.special_token_ids = sorted((tags | set(hf.all_special_ids)) & set(range(vocab_size)))
        self.tokens = tok.token_bytes(range(vocab_size))
        for i in self.special_token_ids:
            self.tokens[i] = str(added[i].content).encode() if i in added else self.tokens[i]
        self.eos_token_id = min(tok.eog_ids) if tok.eog_ids else None
        self.bos_token_id = hf.bos_token_id
        self._encode = tok.encode_text
        self._ids = {
            b: i for i, b in enumerate(self.tokens) if b and i not in self.special_token_ids
        }
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str) -> list[int]:
        """The library tokenizes forced text with this; ids must spell the text exactly,
        and a tokenizer that normalizes (drops a lone space, say) does not: then the
        longest piece at each point."""
        ids = self._encode(text)
        data = text.encode()
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        out, at = [], 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                if data[at : at + n] in self._ids:
                    out.append(self._ids[data[at : at + n]])
                    at += n
                    break
            else:
                return ids  # no piece spells this byte: the library's own fallback
        return out


def _is_tag(text: str) -> bool:
    return text.startswith("<") and text.endswith(">") and len(text) > 2 and " " not in text
