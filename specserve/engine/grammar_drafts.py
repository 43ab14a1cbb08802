"""Drafts under a grammar: what a constrained slot verifies instead of its speculator's draft.

A draft is cut before the first token the grammar forbids (no verify rows on impossible
tokens); where the grammar forces the next tokens and the draft does not begin with them,
those tokens are the draft (exact: they are verified like any draft, and greedy argmax over a
mask with one allowed token is that token).
"""

from __future__ import annotations

import logging

from specserve.engine.request import Request
from specserve.speculative.base import Draft
from specserve.speculative.verify import VerifyResult

log = logging.getLogger("specserve.engine")


def grammar_draft(req: Request, draft: Draft, room: int) -> Draft:
    """The draft `req` verifies: `draft` if it has no grammar, else cut or replaced as above.
    room: how many draft tokens its slot can still take."""
    constraint = req.constraint
    if constraint is None:
        return draft
    try:
        forced = constraint.forced()
        tokens = draft.tokens[: constraint.valid_prefix(draft.tokens)]
    except Exception:
        log.exception("request %d: no grammar draft this step", req.id)
        return Draft()  # drafts never change the output: a failure here costs only them
    if room <= 0:
        return Draft()
    forced = forced[:room]
    if tokens[: len(forced)] == forced[: len(tokens)] and len(tokens) >= len(forced):
        if len(tokens) == len(draft):
            return draft
        return Draft(tokens, tier=draft.tier, source=draft.source)
    return Draft(forced, source="grammar")  # the tokens the grammar forces


def kept_of(draft: Draft, result: VerifyResult) -> int:
    """How many of `draft`'s tokens stand in the accepted part of `result`."""
    n = 0
    while n < min(len(draft), result.accepted) and draft.tokens[n] == result.tokens[n]:
        n += 1
    return n
