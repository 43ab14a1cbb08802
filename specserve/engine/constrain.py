"""Constrained decoding (OpenAI's JSON mode): every emitted token keeps the output a prefix
of a JSON object, and the end-of-generation token comes only once the object is whole.

No vocabulary-wide mask is built. A greedy row takes the most likely token the grammar
allows, looked for in logit order (most rows: their argmax); a sampled row draws from the
request's distribution and, while the draw is not allowed, removes it and draws again
with a fresh uniform of the same position (rejection: exactly the distribution restricted
to the allowed tokens). A first draw or argmax that is allowed is what unconstrained
decoding would emit.

Speculation: row i of [last, d1..dk] is judged in the grammar state after d1..di, the
state plain decoding would be in there, and each row's choice depends only on its logits,
that state and its position's randomness. So a draft is verified by the sampled rule
(drafts with probabilities too: it is exact for any draft), and the output with drafts
equals the output without, token for token.

If no token is allowed (the request has no end-of-generation id, or top-k / top-p left no
allowed token), the row falls back to its highest-scoring allowed token, then to its
argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specserve.engine import json_grammar
from specserve.engine.json_grammar import State
from specserve.speculative.verify import (
    Stream,
    VerifyResult,
    position_uniforms,
    ranked_ids,
    sample_from_probs,
)

MAX_DRAWS = 64  # draws per sampled row before the greedy fallback


class JsonConstraint:
    """One request's grammar state. table: each token id's bytes (b"" for special and
    unused ids, which are never allowed); end_ids: the request's end-of-generation ids."""

    def __init__(self, table: Sequence[bytes], end_ids: frozenset[int]) -> None:
        self.table = table
        self.end_ids = end_ids
        self.state: State = json_grammar.START

    def after(self, state: State, token: int) -> State | None:
        """The state once `token` is emitted in `state`; None if it is not allowed."""
        if token in self.end_ids:
            return state if json_grammar.done(state) else None
        data = self.table[token] if token < len(self.table) else b""
        return json_grammar.advance(state, data) if data else None

    def feed(self, tokens: Sequence[int]) -> None:
        """Emitted tokens (allowed ones, or a fallback's) move the request's state."""
        for token in tokens:
            self.state = self.after(self.state, token) or self.state


def verify_constrained(
    constraint: JsonConstraint,
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    draft: Sequence[int],
    seed: int,
    position: int,
) -> VerifyResult:
    """logits: [k + 1, V] (penalised, biased); probs: their sampling distribution, None
    for greedy; position: that of the first token this step emits."""
    state = constraint.state
    for i in range(len(draft) + 1):
        allowed = _allowed(constraint, state)
        if probs is None:
            token = pick_greedy(logits[i], allowed)
        else:
            token = pick_sampled(probs[i], allowed, seed, position + i, logits[i])
        if i == len(draft) or token != draft[i]:
            return VerifyResult(i, [*draft[:i], token])
        state = constraint.after(state, token) or state
    raise AssertionError("unreachable")


def _allowed(constraint: JsonConstraint, state: State) -> Callable[[int], bool]:
    return lambda token: constraint.after(state, token) is not None


def pick_greedy(row: torch.Tensor, allowed: Callable[[int], bool]) -> int:
    """The allowed token of highest logit (ties: lowest id, as argmax); the argmax if none."""
    x = row.detach().cpu().numpy()
    best = int(x.argmax())
    if allowed(best):
        return best
    checked = 0
    for k in (16, 256, 4096, len(x)):
        order = ranked_ids(x, k)
        # a larger set sorted the same way starts with the smaller one: skip what was seen
        for token in order[checked:]:
            if allowed(token):
                return int(token)
        checked = len(order)
    return best


def pick_sampled(
    probs: torch.Tensor,
    allowed: Callable[[int], bool],
    seed: int,
    position: int,
    logits: torch.Tensor,
) -> int:
    """A draw from probs restricted to the allowed tokens (first draw: the unconstrained
    sample's uniform; draw r: the stream RETRY + r of the same position)."""
    p = probs.detach().to(torch.float64).clone()
    for r in range(MAX_DRAWS):
        if not p.sum() > 0:
            break
        stream = Stream.SAMPLE if r == 0 else int(Stream.RETRY) + r
        u = position_uniforms([seed], [position], stream, p.device)
        token = int(sample_from_probs(p.unsqueeze(0), u)[0])
        if allowed(token):
            return token
        p[token] = 0
    return pick_greedy(logits, allowed)
