"""One request's grammar, as the engine uses it.

A row of the model's scores picks its token as unconstrained decoding would, and only if
the grammar forbids that token is a vocabulary mask computed: greedy takes the allowed
token of highest score, sampling draws again from the request's distribution restricted
to the allowed tokens. Either way the token follows p restricted to the grammar exactly
(a rejected first draw and a masked redraw sum to p(t) / p(allowed)), and most rows pay
one membership test instead of a mask.

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
from specserve.grammar.formats import GrammarError
from specserve.speculative.verify import Stream, VerifyResult, position_uniforms, sample_from_probs


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


def verify_constrained(
    constraint: GrammarConstraint,
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    draft: Sequence[int],
    seed: int,
    position: int,
) -> VerifyResult:
    """logits: [k + 1, V] (penalised, biased) for [last, d1..dk]; probs: their sampling
    distribution, None for greedy; position: that of the first token this step emits."""
    tokens: list[int] = []
    try:
        for i in range(len(draft) + 1):
            p = None if probs is None else probs[i]
            token = pick(constraint, logits[i], p, seed, position + i)
            tokens.append(token)
            if i == len(draft) or token != draft[i]:
                break
            constraint.push(token)
    finally:
        constraint.settle()
    return VerifyResult(len(tokens) - 1, tokens)


def pick(
    constraint: GrammarConstraint,
    row: torch.Tensor,
    p: torch.Tensor | None,
    seed: int,
    position: int,
) -> int:
    """One row's token under the grammar (p: the row's distribution; None for greedy)."""
    if p is None:
        token = int(row.argmax())
    else:
        u = position_uniforms([seed], [position], Stream.SAMPLE, p.device)
        token = int(sample_from_probs(p.unsqueeze(0), u)[0])
    if constraint.allows(token):
        return token
    mask = constraint.mask(row.shape[-1])
    if not bool(mask.any()):
        raise SpecserveError("the grammar allows no token here")
    if p is not None:
        kept = torch.where(mask, p.to(torch.float64), 0.0)
        if kept.sum() > 0:
            u = position_uniforms([seed], [position], Stream.RETRY, p.device)
            return int(sample_from_probs(kept.unsqueeze(0), u)[0])
    # greedy, or top-k / top-p left no allowed token: the allowed token of highest score
    token = int(torch.where(mask, row, float("-inf")).argmax())
    if not constraint.allows(token):  # a dead end: what the grammar wants no token spells
        raise SpecserveError("the grammar allows no token of this vocabulary here")
    return token
