"""Constrained decoding (OpenAI's JSON mode): every emitted token keeps the output a prefix
of a JSON object, and the end-of-generation token comes only once the object is whole.

`JsonConstraint` is the `Constraint` (speculative/verify.py) of JSON mode: it answers which
token may come next by advancing the recognizer's immutable states (engine/json_grammar.py)
along each candidate's bytes, so no vocabulary-wide mask is built; verification picks and
judges drafts with it (`verify_constrained`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specserve.engine import json_grammar
from specserve.engine.json_grammar import State


class JsonConstraint:
    """One request's grammar state. table: each token id's bytes (b"" for special and
    unused ids, which are never allowed); end_ids: the request's end-of-generation ids."""

    def __init__(self, table: Sequence[bytes], end_ids: frozenset[int]) -> None:
        self.table = table
        self.end_ids = end_ids
        self.state: State = json_grammar.START
        # (token, state after it) along the prefix `allowed` was asked for last, from
        # `_walked_from`: verification asks for draft[:0], draft[:1], ... in turn, and
        # walking each from the start would cost the square of the draft's length
        self._walked: list[tuple[int, State]] = []
        self._walked_from: State = self.state

    def after(self, state: State, token: int) -> State | None:
        """The state once `token` is emitted in `state`; None if it is not allowed."""
        if token in self.end_ids:
            return state if json_grammar.done(state) else None
        data = self.table[token] if token < len(self.table) else b""
        return json_grammar.advance(state, data) if data else None

    def allowed(self, prefix: Sequence[int]) -> Callable[[int], bool]:
        """Whether a token may follow the output and then `prefix` (a refused token of the
        prefix leaves the state where it was, as in `feed`)."""
        state = self._state_after(prefix)
        return lambda token: self.after(state, token) is not None

    def feed(self, tokens: Sequence[int]) -> None:
        """Emitted tokens (allowed ones, or a fallback's) move the request's state."""
        for token in tokens:
            self.state = self.after(self.state, token) or self.state

    def _state_after(self, prefix: Sequence[int]) -> State:
        walked = self._walked
        if self._walked_from is not self.state:
            walked.clear()
            self._walked_from = self.state
        n = 0
        while n < min(len(walked), len(prefix)) and walked[n][0] == prefix[n]:
            n += 1
        del walked[n:]
        state = walked[-1][1] if walked else self.state
        for token in prefix[n:]:
            state = self.after(state, token) or state
            walked.append((token, state))
        return state
