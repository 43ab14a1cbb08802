"""The low-bit kernels' naive twin (ops/naive/lowbit.py) on its own: x's quantization, the
record writer (ops/fast/lowbit.py) read back by the twin's formulas, the single rounding of
its fma, and its float32 arithmetic against float64. The kernels are compared with it in
tests/models/test_lowbit.py and test_lowbit_kquants.py."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from specserve.ops.fast import lowbit as fast
from specserve.ops.naive.lowbit import (
    GROUP,
    Q4,
    Q4K,
    Q5,
    Q6,
    Q6K,
    Q8,
    READERS,
    fma32,
    int4_groups,
    int5_groups,
    int6_groups,
    lowbit_linear,
    q8_blocks,
    quantize_x,
)


@pytest.mark.parametrize("group", [32, 256])
def test_x_is_int8_within_half_a_step_of_its_scale(group: int) -> None:
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)) * 3
    x[2] = 0  # a zero row: scale 0, q 0
    q, d = quantize_x(x, group)
    assert q.dtype == torch.int8 and q.shape == (5, 16, GROUP) and d.shape == (5, 16)
    err = x.double().view(5, 16, GROUP) - d.double()[..., None] * q.double()
    assert (err.abs() <= d.double()[..., None] * (0.5 + 1e-4)).all()
    # one scale per group, whose largest |x| becomes 127
    per = d.view(5, -1, group // GROUP)
    assert torch.equal(per, per[..., :1].expand_as(per))
    top = q.view(5, -1, group).abs().amax(-1)
    assert (top[[0, 1, 3, 4]] == 127).all() and (q[2] == 0).all() and (d[2] == 0).all()


def _values(kind: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Random values of a kind, in the form its reader gives them back."""
    g = torch.Generator().manual_seed(kind)
    w = torch.randn(n, k, generator=g)
    if kind in (Q8, Q4, Q5, Q6):
        return {Q8: q8_blocks, Q4: int4_groups, Q5: int5_groups, Q6: int6_groups}[kind](w)
    q = torch.randint(0, 16 if kind == Q4K else 64, (n, k), generator=g, dtype=torch.int32)
    if kind == Q6K:
        sc = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
        d = torch.rand(n, k // 256, 1, generator=g).half().float().expand(-1, -1, 8)
        return q, d.reshape(n, k // GROUP), sc
    sc, m = (torch.randint(0, 64, (n, k // GROUP), generator=g, dtype=torch.int32) for _ in "sm")
    d, dmin = (torch.rand(n, k // 256, generator=g).half().float() for _ in "dm")
    return q, sc, m, d, dmin


WRITERS = {
    Q8: fast.q8_records,
    Q4: fast.q4_records,
    Q5: lambda q, scale, low: fast.q5_records(q, scale),  # low = -16 scale: implied
    Q6: fast.q6_records,
    Q4K: fast.q4k_records,
    Q6K: fast.q6k_records,
}
RECORD_BYTES = {Q8: 272, Q4: 160, Q5: 176, Q6: 224, Q4K: 1184, Q6K: 1680}
NAMES = ["q8", "q4", "q5", "q6", "q4k", "q6k"]


@pytest.mark.parametrize("kind", range(6), ids=NAMES)
def test_the_twin_reads_back_what_the_writer_wrote(kind: int) -> None:
    # 21 outputs: the last tile of 8 holds 5 and 3 zero outputs
    values = _values(kind, 21, 512)
    records = WRITERS[kind](*values)
    inputs = 256 if kind in (Q4K, Q6K) else GROUP
    assert records.dtype == torch.uint8
    assert records.shape == (3, 512 // inputs, RECORD_BYTES[kind])
    for got, want in zip(READERS[kind](records, 21), values, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # the 3 outputs that pad the last tile are zeros (q5's offset meets a zero scale)
    assert all((v[21:] == 0).all() for v in READERS[kind](records, 24)[:-1])


def _nearest_float32(exact: Fraction) -> float:
    """The float32 nearest to `exact`, ties to even, found from its neighbours."""
    r = np.float32(float(exact))  # within one float32 step of the answer
    around = [np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf))]
    key = [(abs(Fraction(float(c)) - exact), int(np.float32(c).view(np.int32)) & 1) for c in around]
    return float(around[key.index(min(key))])


def test_fma32_rounds_once() -> None:
    # (1 + 2^-12)^2 + 2^-70 lies just above a float32 midpoint: rounded to float64 first it
    # would land on the midpoint, and ties to even would take it down
    a = torch.tensor([1 + 2**-12], dtype=torch.float32)
    c = torch.tensor([2**-70], dtype=torch.float32)
    assert fma32(a, a, c).item() == 1 + 2**-11 + 2**-23
    assert ((a.double() * a.double() + c.double()).float()).item() == 1 + 2**-11
    g = torch.Generator().manual_seed(1)
    a, b, c = (
        torch.randn(200, generator=g) * torch.exp2(torch.randint(-20, 20, (200,), generator=g))
        for _ in "abc"
    )
    for ai, bi, ci, got in zip(
        a.tolist(), b.tolist(), c.tolist(), fma32(a, b, c).tolist(), strict=True
    ):
        assert got == _nearest_float32(Fraction(ai) * Fraction(bi) + Fraction(ci))


@pytest.mark.parametrize("kind", range(6), ids=NAMES)
def test_the_twins_float32_steps_approximate_float64(kind: int) -> None:
    values = _values(kind, 21, 512)
    records, x = WRITERS[kind](*values), torch.randn(6, 512, generator=torch.Generator())
    bias = torch.randn(21)
    got = lowbit_linear(x, [records], [kind], [21], bias)
    exact = lowbit_linear(x, [records], [kind], [21], bias, dtype=torch.float64)
    assert got.dtype == torch.float32 and exact.dtype == torch.float64
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5), (got - exact).abs().max()
    # parts side by side are each part alone
    alone = lowbit_linear(x, [records], [kind], [21])
    both = lowbit_linear(x, [records, records], [kind, kind], [21, 21])
    assert torch.equal(both, torch.cat([alone, alone], dim=1))
