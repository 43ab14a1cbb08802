"""Alternatives in a step: which slots verify them, what of a draft's is verified, and
where a kept one's row is (speculative/verify.py `verify_greedy`, batch.py `branches`).
"""

from __future__ import annotations

from specserve.engine.request import Request
from specserve.speculative.base import Draft
from specserve.speculative.verify import VerifyResult


def branches(req: Request, recurrent: bool) -> bool:
    """Whether the slot can verify alternatives: only a KV-only target can drop their rows,
    and only greedy decoding without penalties or a grammar judges them."""
    params = req.params
    return not recurrent and params.greedy and not params.has_penalties and req.constraint is None


def branchable(req: Request, d: Draft, room: int, recurrent: bool) -> Draft:
    """`d`, less its alternatives where they cannot be verified (`branches`), where the
    tokens they stand in for are gone (a grammar cut it), or beyond the request's number a
    token or the slot's room (`room`: positions it has left)."""
    if not d.alternatives:
        return d
    n = min(req.spec.alternatives * len(d), room - len(d)) if branches(req, recurrent) else 0
    keep = [j for j, i in enumerate(d.alt_at) if i < len(d)][: max(n, 0)]
    return d if len(keep) == len(d.alternatives) else d.branched(keep)


def kept_row(req: Request, verified: Draft, result: VerifyResult) -> int | None:
    """Where the kept alternative's row was stored in the slot's cache, its rows being fed
    from len(context) - 1 (engine/timed_forward.py); None where none was kept."""
    row = _alternative_row(verified, result)
    return None if row is None else len(req.context) - 1 + row


def deciding_rows(verified: Draft, result: VerifyResult) -> list[int] | None:
    """The rows that decided result.tokens where an alternative was kept (those up to it,
    then its own); None where the rows are in order already."""
    row = _alternative_row(verified, result)
    return None if row is None else [*range(result.accepted), row]


def _alternative_row(verified: Draft, result: VerifyResult) -> int | None:
    """The kept alternative's row among the slot's [last, d1..dk, a1..am]; None if none."""
    return None if result.branch is None else len(verified) + 1 + result.branch
