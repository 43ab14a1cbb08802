"""A drafter's picks (speculative/picks.py): our float32 kernel and the torch reference pick
the same tokens in the same order, ties included, at the same probabilities."""

from __future__ import annotations

import pytest
import torch

from specserve.ops.cpu.build import problem
from specserve.speculative.picks import likeliest, top_tokens

pytestmark = pytest.mark.skipif(problem() is not None, reason=f"CPU kernels: {problem()}")


def test_a_drafters_picks_are_the_kernels_and_the_reference_alike() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(16003, generator=g) * 4
    logits[7] = logits[11] = logits.max() + 1  # tied first: the first of them first
    fast = top_tokens(logits, 3)  # float32: the kernel
    slow = top_tokens(logits.double(), 3)  # float64: a softmax and a stable sort
    assert [t for t, _ in fast] == [t for t, _ in slow]
    assert [t for t, _ in fast][:2] == [7, 11]
    assert max(abs(a - b) for (_, a), (_, b) in zip(fast, slow, strict=True)) < 1e-6
    assert likeliest(logits) == fast[0]
    assert likeliest(logits.double())[0] == 7


def test_tied_tokens_come_in_index_order_on_both_paths() -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(50):
        width = int(torch.randint(1, 40, (1,), generator=g))
        logits = torch.randint(0, 5, (width,), generator=g).float()  # ties everywhere
        for n in (1, 2, 5):
            want = torch.softmax(logits.double(), dim=-1).sort(descending=True, stable=True)
            ids = want.indices[:n].tolist()
            assert [t for t, _ in top_tokens(logits, n)] == ids  # the kernel
            assert [t for t, _ in top_tokens(logits.double(), n)] == ids  # the reference
