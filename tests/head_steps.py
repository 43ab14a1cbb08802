"""Cached steps of a one-layer draft head (EAGLE-3, MTP) over two slots, on random inputs:
what the heads' catch-up tests run their whole-layer and last-rows paths through."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.batch import FlatBatch
from specserve.cache.kv import KVCache

# (starts, lengths): a prefill of each slot, then 3 and 1 rows, then 2 and 1 (one row before
# the last ones: a head's `forward_last` runs its whole layer there)
STEPS = (([0, 0], [6, 4]), ([6, 4], [3, 1]), ([9, 5], [2, 1]))

Step = Callable[[torch.Tensor, torch.Tensor, FlatBatch, KVCache], object]


def run_steps(
    step: Step, cache: KVCache, width: int, dtype: torch.dtype = torch.float32
) -> list[tuple[object, FlatBatch]]:
    """Each of STEPS through step(embeds, states, batch, cache), the inputs [n, width] drawn
    from one seeded stream: (its output, its batch) per step."""
    g = torch.Generator().manual_seed(3)
    outs = []
    with torch.no_grad():
        for starts, lengths in STEPS:
            n = sum(lengths)
            embeds = torch.randn(n, width, generator=g, dtype=dtype)
            states = torch.randn(n, width, generator=g, dtype=dtype)
            batch = FlatBatch.build([0, 1], starts, lengths, "cpu")
            outs.append((step(embeds, states, batch, cache), batch))
    return outs
