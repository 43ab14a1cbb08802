"""The fast cached attention equals the naive reference (float64), across batch shapes."""

from __future__ import annotations

import pytest
import torch

from specserve.models.batch import FlatBatch
from specserve.ops.fast.attention import cached_attention as fast
from specserve.ops.naive.attention import cached_attention as naive

CASES = {
    "decode-one-slot": ([0], [9], [1], None),
    "verify-rows": ([1], [20], [5], None),
    "prefill-from-zero": ([0], [0], [12], None),
    "mixed-batch": ([2, 0, 1], [0, 7, 30], [6, 1, 4], None),
    "window-decode": ([0], [40], [1], 8),
    "window-verify": ([1, 0], [33, 2], [5, 7], 6),
}


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
@pytest.mark.parametrize("heads", [(4, 2), (6, 1), (3, 3)], ids=["gqa2", "mqa", "mha"])
def test_fast_equals_naive(case: tuple, heads: tuple[int, int]) -> None:
    slots, starts, lens, window = case
    H, hkv = heads
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(3, 64, hkv, 8, generator=g, dtype=torch.float64)
    v_cache = torch.randn(3, 64, hkv, 8, generator=g, dtype=torch.float64)
    batch = FlatBatch.build(slots, starts, lens, torch.device("cpu"))
    q = torch.randn(batch.num_tokens, H, 8, generator=g, dtype=torch.float64)
    want = naive(q, k_cache, v_cache, batch, 0.3, window)
    got = fast(q, k_cache, v_cache, batch, 0.3, window)
    assert (got - want).abs().max().item() < 1e-12
