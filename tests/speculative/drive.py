"""Driving a speculator the way the engine does, against a known greedy output `truth`."""

from __future__ import annotations

import random
from collections.abc import Sequence

from specserve.speculative.base import DraftRequest, Speculator


def draft(
    spec: Speculator, slot: int, tokens: Sequence[int], n_max: int = 64, n_min: int = 0
) -> list[int]:
    """One engine step for one slot: the tokens it proposes."""
    return spec.draft([DraftRequest(slot, list(tokens), n_max, n_min=n_min)])[0].tokens


def generate(
    spec: Speculator, truth: list[int], start: int, slot: int = 0, n_max: int = 64
) -> tuple[int, int]:
    """Run the engine loop over `truth` from `start` tokens on; return (steps, tokens accepted).

    Each step drafts, keeps the prefix that agrees with `truth` and emits one more token,
    exactly as greedy verification against a target that produces `truth` would.
    """
    spec.begin(slot, truth[:start])
    length, steps, accepted = start, 0, 0
    while length < len(truth):
        d = draft(spec, slot, truth[:length], n_max=n_max)
        n_acc = 0  # the token emitted after the accepted ones must still be inside `truth`
        while (
            n_acc < len(d) and length + n_acc + 1 < len(truth) and d[n_acc] == truth[length + n_acc]
        ):
            n_acc += 1
        spec.accept(slot, n_acc)
        length, steps, accepted = length + n_acc + 1, steps + 1, accepted + n_acc
    return steps, accepted


def random_tokens(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def distinct_tokens(seed: int, length: int) -> list[int]:
    """Text without a repeated token, sharing none with other seeds: nothing to draft from."""
    return random.Random(seed).sample(range(seed * 10**6, (seed + 1) * 10**6), length)
