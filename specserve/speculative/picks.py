"""A drafter's picks from a row of its logits: its token and that token's probability, and
the tokens it ranks next (a draft's alternatives, base.py `Draft.add`)."""

from __future__ import annotations

import torch

from specserve.ops.cpu.build import kernels_for


def top_tokens(logits: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The n likeliest tokens of a row of logits [V], likeliest first, each with its
    softmax probability, as a drafter asks at every draft token: one pass of our float32
    kernel, else one softmax and a topk (an argmax and a logsumexp over the row cost a
    head's ask more, docs/perf/2026-11-29-head-asks.md). Of tied tokens the first comes
    first either way: topk leaves their order open, so those at least its n-th are ranked
    again, stably, in index order."""
    kernels = kernels_for(logits)
    if kernels is not None:
        (ids,), (probs,) = kernels.top_softmax(logits.reshape(1, -1), n)
        return list(zip(ids, probs, strict=True))
    probs = torch.softmax(logits.float(), dim=-1)
    if n == 1:  # max gives the first of tied maxima, in one pass
        p, best = probs.max(dim=-1)
        return [(int(best), float(p))]
    nth = probs.topk(min(n, probs.shape[-1])).values[-1]
    ids = (probs >= nth).nonzero().flatten()  # in index order
    ids = ids[probs[ids].sort(descending=True, stable=True).indices[:n]]
    return list(zip(ids.tolist(), probs[ids].tolist(), strict=True))


def likeliest(logits: torch.Tensor) -> tuple[int, float]:
    """The likeliest token of a row of logits [V] and its probability."""
    return top_tokens(logits, 1)[0]
