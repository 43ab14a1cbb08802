"""A drafter's picks from a row of its logits: its token and that token's probability, and
the tokens it ranks next (a draft's alternatives, base.py `Draft.add`)."""

from __future__ import annotations

import math

import torch

from specserve.ops.cpu.build import kernels_for


def likeliest(logits: torch.Tensor) -> tuple[int, float]:
    """The likeliest token of a row of logits [V] and its probability, as a drafter asks at
    every draft token: one pass of our float32 kernel, else one softmax (an argmax and a
    logsumexp over the row cost a head's ask more, docs/perf/2026-11-29-head-asks.md)."""
    kernels = kernels_for(logits)
    if kernels is not None:
        (best,), (p,) = kernels.top1_softmax(logits.reshape(1, -1))
        return best, p
    p, best = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    return int(best), float(p)


def runners_up(logits: torch.Tensor, best: int, p: float, n: int) -> list[tuple[int, float]]:
    """The n likeliest tokens of a row of logits [V] after `best` (whose probability is
    p), each with its probability: p scaled by its odds against `best`."""
    if n <= 0:
        return []
    values, ids = torch.topk(logits, min(n + 1, logits.shape[-1]))
    top = float(values[0])
    ranked = zip(values.tolist(), ids.tolist(), strict=True)
    return [(t, p * math.exp(v - top)) for v, t in ranked if t != best][:n]
