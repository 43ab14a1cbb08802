"""Token ids -> text deltas, incrementally, with OpenAI `stop` strings.

Streaming and non-streaming responses both build their text from `TextStream`, so they
give the same text by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]


class TextStream:
    """Incremental detokenizer (vLLM's prefix/read offsets) that stops at stop strings.

    Decoding each new token alone is wrong for tokenizers that merge bytes across tokens
    or strip a leading space at the start of a decode; decoding the whole output every
    step costs O(n^2). So, as vLLM does, it decodes a short window: the text of
    ids[prefix:read] (already emitted) and of ids[prefix:]; the new text is the
    difference. A window ending in U+FFFD is an unfinished UTF-8 sequence: wait for more.

    Text that could be the start of a stop string is held back until it is clearly not.
    Example with stop=["\\n\\n"]: push -> "Hi\\n" emits "Hi" and holds "\\n"; push -> "\\nB"
    finds the stop string, `stopped` becomes True and nothing more is emitted.
    """

    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] decode to text already taken into `_text`
        self._read = 0
        self._text = ""  # all text decoded so far
        self._emitted = 0  # characters of `_text` handed out
        self.n_tokens = 0
        self.stopped = False

    def push(self, ids: Sequence[int]) -> str:
        """Add newly generated ids -> the text that is now safe to emit (maybe "")."""
        if self.stopped:
            return ""
        self._ids.extend(ids)
        self.n_tokens += len(ids)
        self._text += self._decode_new(final=False)
        return self._release(final=False)

    def push_each(self, ids: Sequence[int]) -> tuple[str, int]:
        """`push` one id at a time, up to the one that completes a stop string -> (text,
        ids taken). A verified draft brings several ids in one step; taken one by one, a
        stop string inside it ends the text and the count where a step of one id would."""
        text = ""
        for n, token in enumerate(ids, 1):
            text += self.push([token])
            if self.stopped:
                return text, n
        return text, len(ids)

    def flush(self) -> str:
        """The generation ended: emit everything held back (unfinished bytes included)."""
        if self.stopped:
            return ""
        self._text += self._decode_new(final=True)
        return self._release(final=True)

    def _decode_new(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _release(self, final: bool) -> str:
        start = self._emitted
        # a stop string never starts before `start`: text that might begin one is held back
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            end = min(hits)
            self.stopped = True
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_back()
        self._emitted = end
        return self._text[start:end]

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return max((partial_prefix(self._text, s) for s in self._stop), default=0)


def partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: text a
    stream holds back until it is clearly not the start of the marker.

    Only the last len(marker) - 1 characters can matter, and only where marker[0] occurs
    in them; the earliest such start that fits is the longest (string search in C, so a
    stream's many stop strings cost little per token)."""
    if len(marker) < 2:
        return 0
    i = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while i >= 0:
        if marker.startswith(text[i:]):
            return len(text) - i
        i = text.find(marker[0], i + 1)
    return 0
