"""One request's grammar, as verification and drafting use it: speculative/verify.py's
`Constraint` on an llguidance matcher (the rule that picks a row's token under it is
`pick_constrained` there).

Speculation: row i of [last, d1..dk] is judged in the grammar state after d1..di (pushed
on trial and taken back), the state plain decoding would be in there; each row's choice
depends only on its scores, that state and its position's randomness. So the output with
drafts equals the output without, token for token. A draft is cut before the first token
the grammar forbids (no verify row is spent on it), and the tokens a state forces (`{"`
of a schema, a tool's name) are offered as a draft of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from specserve.errors import SpecserveError
from specserve.grammar.formats import Grammar, GrammarError, compile_grammar
from specserve.grammar.vocab import grammar_vocab
from specserve.loading.tokenizer import Tokenizer


class GrammarConstraint:
    """A request's llguidance matcher. end_ids: the request's end-of-generation ids, allowed
    exactly where the grammar's output is whole."""

    def __init__(
        self, vocab: llguidance.LLTokenizer, grammar: str, end_ids: frozenset[int]
    ) -> None:
        self.matcher = llguidance.LLMatcher(vocab, grammar)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {self.matcher.get_error()}")
        self.end_ids = end_ids
        self._trial = 0  # tokens pushed while a draft is judged, taken back after

    def allows(self, token: int) -> bool:
        """Whether `token` may come next."""
        if token in self.end_ids:
            return bool(self.matcher.is_accepting())
        return bool(self.matcher.validate_tokens([token]) == 1)

    def mask(self, size: int) -> torch.Tensor:
        """[size] bool: the tokens that may come next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:size].astype(bool)
        out = np.zeros(size, dtype=bool)
        out[: len(allowed)] = allowed
        return torch.from_numpy(out)

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many leading tokens of `draft` the grammar allows in the current state."""
        return int(self.matcher.validate_tokens(list(draft))) if draft else 0

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would say (the library
        spells forced bytes in canonical tokens; a spelling the grammar would not take back,
        as a byte the vocabulary lacks, ends the run)."""
        run = list(self.matcher.compute_ff_tokens())
        return run[: self.valid_prefix(run)]

    def feed(self, tokens: Sequence[int]) -> None:
        """Emitted tokens move the request's state (an end id ends the output: nothing to
        move)."""
        for token in tokens:
            if token in self.end_ids:
                continue
            if not self.matcher.consume_token(token):
                raise SpecserveError(
                    f"the grammar refused token {token}: {self.matcher.get_error()}"
                )

    def push(self, token: int) -> None:
        self.feed([token])
        self._trial += 1

    def settle(self) -> None:
        """Take back the tokens pushed on trial."""
        if self._trial:
            self.matcher.rollback(self._trial)
            self._trial = 0


def build_constraint(tok: Tokenizer, vocab_size: int, grammar: Grammar) -> GrammarConstraint:
    """A request's constraint for `grammar` over a model of `vocab_size` rows (GrammarError,
    quoting the library, for a grammar that does not compile)."""
    vocab = grammar_vocab(tok, vocab_size)
    return GrammarConstraint(vocab, compile_grammar(grammar, vocab), tok.eog_ids)
