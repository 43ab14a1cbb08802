"""A drafter's picks from a row of its logits: its token and that token's probability, and
the tokens it ranks next (a draft's alternatives, base.py `Draft.add`)."""

from __future__ import annotations

import torch

from specserve.ops.cpu.build import kernels_for


def top_tokens(logits: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The n likeliest tokens of a row of logits [V], likeliest first, each with its
    softmax probability, as a drafter asks at every draft token: one pass of our float32
    kernel, else one softmax and a stable sort (an argmax and a logsumexp over the row cost
    a head's ask more, docs/perf/2026-11-29-head-asks.md). Of tied tokens the first comes
    first either way."""
    kernels = kernels_for(logits)
    if kernels is not None:
        (ids,), (probs,) = kernels.top_softmax(logits.reshape(1, -1), n)
        return list(zip(ids, probs, strict=True))
    probs, ids = torch.softmax(logits.float(), dim=-1).sort(descending=True, stable=True)
    return list(zip(ids[:n].tolist(), probs[:n].tolist(), strict=True))


def likeliest(logits: torch.Tensor) -> tuple[int, float]:
    """The likeliest token of a row of logits [V] and its probability."""
    return top_tokens(logits, 1)[0]
