"""The fast cached attention equals the naive reference (float64), across batch shapes."""

from __future__ import annotations

import pytest
import torch

from specserve.batch import FlatBatch
from specserve.models.layers.basic import RotaryEmbedding
from specserve.ops.cpu.build import problem
from specserve.ops.fast.attention import cached_attention as fast
from specserve.ops.naive.attention import cached_attention as naive
from tests.isa import kernel_isas

CASES = {
    "decode-one-slot": ([0], [9], [1], None),
    "verify-rows": ([1], [20], [5], None),
    "prefill-from-zero": ([0], [0], [12], None),
    "mixed-batch": ([2, 0, 1], [0, 7, 30], [6, 1, 4], None),
    "window-decode": ([0], [40], [1], 8),
    "window-verify": ([1, 0], [33, 2], [5, 7], 6),
}
# the CPU kernel walks keys in chunks of 32 and rows in blocks of up to 8: ranges that start
# and end mid-chunk, rows that see different chunks, more rows than a block
LONG_CASES = {
    "verify-across-chunks": ([2], [58], [9], None),
    "window-across-chunks": ([0, 1], [40, 3], [11, 2], 37),
    "prefill-many-blocks": ([1], [0], [75], None),
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


def _kernel_case(case: tuple, shape: tuple[int, int, int]) -> tuple:
    """float32 caches of 80 positions, the batch and its q."""
    slots, starts, lens, window = case
    H, hkv, D = shape
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(3, 80, hkv, D, generator=g)
    v_cache = torch.randn(3, 80, hkv, D, generator=g)
    batch = FlatBatch.build(slots, starts, lens, torch.device("cpu"))
    q = torch.randn(batch.num_tokens, H, D, generator=g) * 0.2
    return q, k_cache, v_cache, batch, window


@pytest.mark.skipif(problem() is not None, reason=f"CPU kernels: {problem()}")
@pytest.mark.parametrize("case", [*CASES.values(), *LONG_CASES.values()], ids=[*CASES, *LONG_CASES])
@pytest.mark.parametrize("shape", [(14, 2, 64), (4, 1, 256), (2, 2, 128)], ids=str)
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_kernel_matches_the_reference_and_is_row_invariant(
    case: tuple, shape: tuple[int, int, int], threads: int, isa: str
) -> None:
    # float32 runs ops/cpu/attention.cpp: close to the float64 reference, and every row
    # equals the same row computed alone (so batch composition cannot change it), on every
    # instruction set and however many threads split the rows
    q, k_cache, v_cache, batch, window = _kernel_case(case, shape)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = fast(q, k_cache, v_cache, batch, 0.125, window)
    finally:
        torch.set_num_threads(before)
    want = naive(q.double(), k_cache.double(), v_cache.double(), batch, 0.125, window)
    assert (got.double() - want).abs().max().item() < 2e-6
    row_slots = [s for s, n in zip(batch.slots, batch.lens(), strict=True) for _ in range(n)]
    for row, (slot, position) in enumerate(zip(row_slots, batch.positions.tolist(), strict=True)):
        one = FlatBatch.build([slot], [position], [1], torch.device("cpu"))
        alone = fast(q[row : row + 1], k_cache, v_cache, one, 0.125, window)
        assert torch.equal(alone, got[row : row + 1]), (slot, position)


@pytest.mark.skipif(len(kernel_isas()) < 2, reason="this CPU has only AVX2: one instruction set")
@pytest.mark.parametrize("case", LONG_CASES.values(), ids=list(LONG_CASES))
@pytest.mark.parametrize("shape", [(14, 2, 64), (4, 1, 256)], ids=str)
def test_cpu_kernel_gives_the_same_bits_on_every_instruction_set(
    case: tuple, shape: tuple[int, int, int]
) -> None:
    # 512-bit vectors change how many keys and heads one instruction serves, not any lane's
    # chain of operations; the softmax is 256-bit code in both
    from specserve.models.layers.lowbit import kernel_isa

    args = _kernel_case(case, shape)
    got = {}
    try:
        for name in kernel_isas():
            kernel_isa(name)
            got[name] = fast(*args[:4], 0.125, args[4])
    finally:
        kernel_isa("auto")
    first = got.pop("avx2")
    for name, out in got.items():
        assert torch.equal(out, first), (name, (out - first).abs().max())


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


# verifications with alternatives (batch.py `branches`): slot 1's rows [last, d1, d2, d3, a1,
# a2] from 29, a1 standing in for d1 and a2 for d2, slot 0's [last, d1, b1] from 40, b1 for
# d1, across chunks
BRANCHED = ([1, 0], [29, 40], [6, 3], [(0, 1), (0,)])


def _in_place(
    caches: tuple[torch.Tensor, torch.Tensor], batch: FlatBatch, row: int
) -> tuple[torch.Tensor, torch.Tensor, FlatBatch]:
    """The caches as they would be had alternative `row` been fed alone at its position (its
    key and value moved there), and that one-row batch."""
    seq = next(i for i, c in enumerate(batch.cu_seqlens[1:]) if row < c)
    slot, pos, at = batch.slots[seq], int(batch.positions[row]), int(batch.rows_at[row])
    k, v = (c.clone() for c in caches)
    k[slot, pos], v[slot, pos] = k[slot, at], v[slot, at]
    return k, v, FlatBatch.build([slot], [pos], [1], torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_an_alternative_sees_the_keys_before_its_position_and_its_own(dtype: torch.dtype) -> None:
    # every path (naive, SDPA, per row, the CPU kernel for float32) gives an alternative what
    # one-token decoding gives it in place, and the other rows what they get without it;
    # the kernel to the bit, as its rows are computed alone
    slots, starts, lens, branches = BRANCHED
    g = torch.Generator().manual_seed(5)
    k_cache = torch.randn(2, 80, 2, 64, generator=g, dtype=dtype)
    v_cache = torch.randn(2, 80, 2, 64, generator=g, dtype=dtype)
    batch = FlatBatch.build(slots, starts, lens, torch.device("cpu"), branches=branches)
    assert batch.positions.tolist() == [29, 30, 31, 32, 30, 31, 40, 41, 41]
    assert batch.rows_at.tolist() == [29, 30, 31, 32, 33, 34, 40, 41, 42]
    q = torch.randn(batch.num_tokens, 4, 64, generator=g, dtype=dtype) * 0.2
    kernel = dtype == torch.float32 and problem() is None
    paths = {"naive": naive, "fast": fast, "per-row": lambda *a: fast(*a, None, True)}
    for name, attend in paths.items():
        # float32 outside the kernel is torch's SDPA, whose sums depend on the shapes
        exact, tol = kernel and name != "naive", 1e-12 if dtype == torch.float64 else 1e-6
        got = attend(q, k_cache, v_cache, batch, 0.125)
        unbranched = [n - len(b) for n, b in zip(lens, branches, strict=True)]
        plain = FlatBatch.build(slots, starts, unbranched, "cpu")
        kept = [r for r in range(batch.num_tokens) if r not in (4, 5, 8)]
        want = attend(q[kept], k_cache, v_cache, plain, 0.125)
        rows = [(got[kept], want)]
        for row in (4, 5, 8):
            k_moved, v_moved, one = _in_place((k_cache, v_cache), batch, row)
            alone = attend(q[row : row + 1], k_moved, v_moved, one, 0.125)
            rows.append((got[row : row + 1], alone))
        for a, b in rows:
            assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=0, atol=tol), name
