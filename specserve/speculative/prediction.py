"""`prediction`: drafts from the text a client expects back (OpenAI's Predicted Outputs).

A client that edits a file sends the old file as `"prediction": {"type": "content",
"content": ...}`; most of the answer repeats it. The drafter keeps, per slot, where in the
predicted tokens the output has got to, and proposes the predicted tokens after that
point. While the output follows the prediction the point just moves on; when the output
leaves it (an edit), the point is found again where the output's latest tokens occur in
the prediction (the longest match of up to MAX_MATCH tokens, the nearest one after the old
point among equals), so drafting resumes after the edit. Requests without a prediction
get empty drafts.

As with every drafter the target verifies each token, so the output is the one it would be
without a prediction: a wrong prediction costs verify rows, never tokens. Each draft's tier
is the length of the match it was aligned by (a continuing alignment counts as the
longest), so acceptance is learnt separately for a weak realignment (speculative/rates.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.speculative.base import Draft, DraftRequest, Speculator, slot_state

MAX_MATCH = 8  # output tokens compared when realigning; also the tier of an unbroken run


@dataclass
class _Slot:
    seen: int  # context length at the last draft (the prompt's, before the first)
    first: int  # where the output starts in the context (the prompt's length)
    predicted: np.ndarray | None = None  # int64 token ids
    at: int = 0  # the predicted token expected next
    match: int = 0  # tokens the current alignment rests on (the tier)


class PredictionSpeculator(Speculator):
    name = "prediction"

    def __init__(self) -> None:
        super().__init__()
        self._slots: dict[int, _Slot] = {}

    def _begin(self, slot: int, prompt: Sequence[int]) -> None:
        self._slots[slot] = _Slot(seen=len(prompt), first=len(prompt))

    def _reset(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self._one(r) for r in requests]

    def _one(self, req: DraftRequest) -> Draft:
        if not req.prediction:
            return Draft()
        # a slot the engine did not begin (drafting driven directly): its context is output
        s = slot_state(self._slots, req.slot, lambda: _Slot(seen=0, first=0))
        if s.predicted is None:
            s.predicted = np.asarray(req.prediction, dtype=np.int64)
        self._follow(s, req.tokens)
        if not s.match or s.at >= len(s.predicted):
            return Draft()
        return Draft(s.predicted[s.at : s.at + req.n_max].tolist(), tier=s.match)

    def _follow(self, s: _Slot, tokens: Sequence[int]) -> None:
        """Move the slot's point past the tokens emitted since the last draft, or realign."""
        assert s.predicted is not None
        new = tokens[s.seen :]
        s.seen = len(tokens)
        ahead = s.predicted[s.at : s.at + len(new)]
        if s.match and len(ahead) == len(new) and np.array_equal(ahead, new):
            s.at += len(new)
            s.match = MAX_MATCH
            return
        recent = tokens[max(s.first, len(tokens) - MAX_MATCH) :]
        s.at, s.match = _realign(s.predicted, recent, s.at)


def _realign(predicted: np.ndarray, recent: Sequence[int], after: int) -> tuple[int, int]:
    """(the index after the best match of `recent`'s tail in `predicted`, its length); the
    longest tail wins, then the first occurrence at or after `after`, else the first. (0,
    0): no match. Vectorised over the occurrences of the last token, so a prediction full
    of it costs MAX_MATCH array passes, not a Python loop per occurrence."""
    if not recent:
        return 0, 0
    tail = np.asarray(recent, dtype=np.int64)
    ends = np.flatnonzero(predicted == tail[-1])  # where the last token occurs
    if not len(ends):
        return 0, 0
    length = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for n in range(1, len(tail)):
        before = ends - n
        alive &= before >= 0
        alive[alive] = predicted[before[alive]] == tail[-1 - n]
        length += alive
    best_len = int(length.max())
    best = ends[length == best_len]
    later = best[best + 1 >= after]
    best_end = int(later[0] if len(later) else best[0])
    return best_end + 1, best_len
