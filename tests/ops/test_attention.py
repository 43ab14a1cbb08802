"""The fast cached attention equals the naive reference (float64), across batch shapes."""

from __future__ import annotations

import pytest
import torch

from specserve.models.batch import FlatBatch
from specserve.models.layers.basic import RotaryEmbedding
from specserve.ops.cpu.build import problem
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


@pytest.mark.skipif(problem() is not None, reason=f"CPU kernels: {problem()}")
@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
@pytest.mark.parametrize("shape", [(14, 2, 64), (4, 1, 256), (2, 2, 128)], ids=str)
def test_cpu_kernel_matches_the_reference_and_is_row_invariant(
    case: tuple, shape: tuple[int, int, int]
) -> None:
    # float32 runs ops/cpu/attention.cpp: close to the float64 reference, and every row
    # equals the same row computed alone (so batch composition cannot change it)
    slots, starts, lens, window = case
    H, hkv, D = shape
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(3, 80, hkv, D, generator=g)
    v_cache = torch.randn(3, 80, hkv, D, generator=g)
    batch = FlatBatch.build(slots, starts, lens, torch.device("cpu"))
    q = torch.randn(batch.num_tokens, H, D, generator=g) * 0.2
    got = fast(q, k_cache, v_cache, batch, 0.125, window)
    want = naive(q.double(), k_cache.double(), v_cache.double(), batch, 0.125, window)
    assert (got.double() - want).abs().max().item() < 2e-6
    row = 0
    for slot, start, n in zip(slots, starts, lens, strict=True):
        for t in range(n):
            one = FlatBatch.build([slot], [start + t], [1], torch.device("cpu"))
            alone = fast(q[row : row + 1], k_cache, v_cache, one, 0.125, window)
            assert torch.equal(alone, got[row : row + 1]), (slot, t)
            row += 1


@pytest.mark.skipif(problem() is not None, reason=f"CPU kernels: {problem()}")
def test_attend_qkv_writes_each_slots_rows_at_its_start_and_refuses_rows_past_the_cache() -> None:
    # the kernel stores the new keys and values with one memcpy a row: slot i's rows go to
    # positions starts[i].., the values unchanged, every other position untouched
    from specserve.ops.cpu.build import load

    kernels = load()
    H, hkv, D, L = 4, 2, 64, 16
    slots, starts, lens = [2, 0], [5, 3], [3, 2]
    batch = FlatBatch.build(slots, starts, lens, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(batch.num_tokens, (H + 2 * hkv) * D, generator=g)
    k_cache, v_cache = torch.zeros(3, L, hkv, D), torch.zeros(3, L, hkv, D)
    rope = RotaryEmbedding(D, 10000.0, 1.0)
    cos, sin = rope.cos_sin(batch.positions, torch.float32)
    args = (cos, sin, batch.slots, batch.starts, batch.cu_seqlens, batch.positions)
    kernels.attend_qkv(qkv, k_cache, v_cache, *args, H, 0.125, 0, None, None, 0.0)
    v_rows = qkv[:, (H + hkv) * D :].view(-1, hkv, D)
    want = torch.zeros_like(v_cache)
    want[2, 5:8], want[0, 3:5] = v_rows[:3], v_rows[3:]
    assert torch.equal(v_cache, want)
    assert torch.equal(k_cache != 0, want != 0)  # keys (rotated) exactly where values went

    late = FlatBatch.build([1], [L - 1], [2], torch.device("cpu"))
    cos, sin = rope.cos_sin(late.positions, torch.float32)
    late_args = (cos, sin, late.slots, late.starts, late.cu_seqlens, late.positions)
    with pytest.raises(RuntimeError, match="rows beyond the cache"):
        kernels.attend_qkv(qkv[:2], k_cache, v_cache, *late_args, H, 0.125, 0, None, None, 0.0)
