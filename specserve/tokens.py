"""Token sequences: what every layer may ask of them (the ground floor: imports nothing of
specserve)."""

from __future__ import annotations

from collections.abc import Sequence


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix: shared_prefix([1, 2, 3], [1, 2, 4]) == 2."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
