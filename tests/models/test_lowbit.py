"""specserve's low-bit kernels: the arithmetic they claim, row for row, at any batch size, on
every instruction set this CPU has (AVX2, and AVX-512 VNNI where present), with the same bits."""

from __future__ import annotations

import pytest
import torch

from specserve.models.layers.lowbit import (
    LowbitLinear,
    Q4Linear,
    Q5Linear,
    Q6KLinear,
    Q6Linear,
    Q8Linear,
    kernel_isa,
)
from specserve.ops.cpu.build import problem
from specserve.ops.naive.lowbit import (
    GROUP,
    int4_groups,
    int5_groups,
    int6_groups,
    lowbit_linear,
    q8_blocks,
)
from tests.isa import kernel_isas
from tests.models.lowbit_cases import (
    KINDS,
    any_kind,
    case,
    q4k_layer,
    q6k_groups,
    record_values,
    reference,
    twin,
)

pytestmark = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")


def test_q8_blocks_give_gguf_q8_0_weights_back_exactly() -> None:
    # Q8_0: per block d (a float16) and q in -127..127 with the block's largest |q| = 127
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (8, 4, GROUP), generator=g)
    q[..., 0] = 127 * torch.sign(torch.randn(8, 4, generator=g)).long()
    d = (torch.rand(8, 4, generator=g) * 0.01).half().float()
    w = (q.float() * d[..., None]).view(8, 4 * GROUP)
    got_q, got_d = q8_blocks(w)
    assert torch.equal(got_q.long().view_as(q), q)
    assert torch.equal(got_d, d)


BLOCKS = {Q8Linear: q8_blocks, Q4Linear: int4_groups, Q5Linear: int5_groups, Q6Linear: int6_groups}


def test_int5_groups_give_gguf_q5_0_weights_back_exactly() -> None:
    # Q5_0: w = d * (q - 16), q in 0..31; the element of largest magnitude has q = 0
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 32, (8, 4, GROUP), generator=g)
    q[..., 5] = 0
    d = ((torch.rand(8, 4, generator=g) - 0.5) * 0.02).half().float()  # either sign
    w = (d[..., None] * (q.float() - 16)).view(8, 4 * GROUP)
    got, scale, low = int5_groups(w)
    assert torch.equal(got.long().view_as(q), q)
    assert torch.equal(scale, d) and torch.equal(low, -16 * d)


@pytest.mark.parametrize("cls", list(BLOCKS))
def test_records_hold_the_blocks(cls: type) -> None:
    # 70 outputs: the last tile of 8 is padded with 2 zero outputs
    w, _, _ = case()
    layer = cls(w, None)
    want = BLOCKS[cls](w)
    assert layer.records.shape[0] == 9
    for got, expected in zip(record_values(layer), want, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("level", [0, 63])
def test_q6_extremes_wrap_16_bits_and_come_back_exact(level: int, isa: str) -> None:
    # unsigned q = 63 against x = 127: four steps' maddubs sums reach 8 * 63 * 127, past
    # int16; less the offset (32 * x's sums) they are 8 * 31 * 127 (q = 0: -8 * 32 * 127)
    n, k = 16, 64
    q = torch.full((n, k), level, dtype=torch.int32)
    d = torch.full((n, k // GROUP), 2.0**-10)
    sc = torch.full((n, k // 16), 127, dtype=torch.int8)
    sc[:, 1::2] = -128  # the other sub-block at the most negative scale
    layer = Q6Linear.from_groups(q, d, sc, None)
    x = torch.ones(3, k)
    x[1] = -1  # the sign of every product flips
    got, ref = layer(x).double(), reference(x, layer)
    assert torch.allclose(got, ref, rtol=1e-6, atol=0), (got - ref).abs().max()
    assert ref.abs().min() > 0.5  # a real, large value, not a cancellation to zero


@pytest.mark.parametrize("top", [False, True], ids=["q0", "q31"])
def test_q5_extremes_wrap_16_bits_and_come_back_exact(top: bool, isa: str) -> None:
    # unsigned q = 31 against x = 127: a lane's 16 products (8 steps) sum to ~16 * 31 * 127, past
    # int16; less 16 times x's sums they are (q - 16) x, which fits (q = 0: -16 * 16 * 127)
    n, k = 16, 64
    w = torch.full((n, k), -15.0 if top else 1.0)
    if top:  # the block's largest |w| sits at q = 0, so d = -1 and every other q is 31
        w[:, ::GROUP] = 16.0
    layer = Q5Linear(w, None)
    q = record_values(layer)[0].view(n, -1, GROUP)
    assert (q[..., 1:] == (31 if top else 0)).all()
    x = torch.ones(3, k)
    x[1] = -1  # the sign of every product flips
    got, ref = layer(x).double(), reference(x, layer)
    assert torch.allclose(got, ref, rtol=1e-6, atol=0), (got - ref).abs().max()
    assert ref.abs().min() > 0.5  # a real, large value, not a cancellation to zero


def test_int4_groups_round_within_half_a_step() -> None:
    w, _, _ = case()
    q, scale, low = int4_groups(w)
    q = q.view(70, -1, GROUP).float()
    back = (q * scale[..., None] + low[..., None]).view_as(w)
    assert ((back - w).abs().view(70, -1, GROUP) <= scale[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("cls", list(BLOCKS))
def test_kernel_computes_the_quantized_arithmetic(cls: type, isa: str) -> None:
    w, bias, x = case()
    layer = cls(w, bias)
    ref = reference(x, layer)
    got = layer(x).double()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4), (got - ref).abs().max()
    # and the quantized product stays near the float one
    assert (
        torch.nn.functional.cosine_similarity(got.flatten(), (x @ w.T + bias).double().flatten(), 0)
        > 0.99
    )


@pytest.mark.parametrize("cls", KINDS)
def test_kernel_gives_the_naive_twins_bits(cls: type, isa: str) -> None:
    # the twin's float32 steps, rounded as the kernel rounds them and in its order
    layer, x = any_kind(cls)
    assert torch.equal(layer(x), twin(x, layer))


def _parts(names: str) -> list[LowbitLinear]:
    """Linears that read one x: GGUF files mix kinds in one q/k/v (the 0.5B's q and k Q5_0,
    v Q8_0; the 1.5B's q and k Q4_K, v Q6_K)."""
    if names == "q4k-q6k":
        return [q4k_layer(64, 1024, seed=3), Q6KLinear.from_groups(*q6k_groups(70, 1024, 5), None)]
    w, bias, _ = case(n=64, k=1024)
    return [Q5Linear(w, bias), Q8Linear(w[:16], None), Q6Linear(w[16:], bias[16:])]


@pytest.mark.parametrize("names", ["q5-q8-q6", "q4k-q6k"])
def test_a_call_over_parts_of_several_kinds_gives_the_twins_bits(names: str, isa: str) -> None:
    from specserve.models.layers.lowbit_fused import FusedLowbit

    fused = FusedLowbit(_parts(names))
    x = case(n=70, k=1024, m=11)[2]
    assert torch.equal(fused(x), lowbit_linear(x, *fused.parts(), fused.bias))


@pytest.mark.parametrize("cls", list(BLOCKS))
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_does_not_depend_on_the_rows_beside_it(cls: type, threads: int, isa: str) -> None:
    # tiles are 8 outputs x up to 4 rows (AVX2) or 8 (VNNI); 70 outputs leave a padded tile
    # of 6; row counts cover every remainder of the row groups
    w, bias, x = case(m=70)
    layer = cls(w, bias)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = layer(x)
        for m in (1, 2, 3, 4, 5, 7, 8, 13, 33, 70):
            for start in (0, 1, 70 - m):
                assert torch.equal(layer(x[start : start + m]), full[start : start + m]), (m, start)
    finally:
        torch.set_num_threads(before)
    torch.set_num_threads(1)
    try:
        assert torch.equal(layer(x), full)  # and the thread count does not matter either
    finally:
        torch.set_num_threads(before)


def test_leading_dims_dtype_and_bad_shapes() -> None:
    w, bias, x = case(m=6)
    layer = Q8Linear(w, bias)
    assert torch.equal(layer(x.view(2, 3, -1)), layer(x).view(2, 3, -1))
    with pytest.raises(ValueError, match="divisible by 32"):
        Q8Linear(torch.randn(4, 40), None)
    with pytest.raises(RuntimeError, match=r"records must be uint8 \[ceil\(N/8\), K/32, 272\]"):
        layer.kernels.lowbit_linear(torch.randn(2, 64), [layer.records], [0], [70], None, None)
    with pytest.raises(RuntimeError, match=r"kind must be 0 \(q8\), .* 4 \(q4k\), 5 \(q6k\)"):
        layer.kernels.lowbit_linear(x, [layer.records], [6], [70], None, None)
    # a part that ends mid-tile would write into the next part's outputs
    with pytest.raises(RuntimeError, match="only the last part may end mid-tile"):
        layer.kernels.lowbit_linear(x, [layer.records] * 2, [0, 0], [70, 70], None, None)


@pytest.mark.parametrize("cls", list(BLOCKS))
def test_output_into_a_callers_buffer(cls: type) -> None:
    # the engine's logits buffer: the same bits, written in place, nothing else touched
    w, bias, x = case(m=5)
    layer = cls(w, bias)
    buf = torch.full((7, 70), float("nan"))
    y = layer.matmul(x, buf[:5])
    assert y.data_ptr() == buf.data_ptr() and torch.equal(y, layer.matmul(x))
    assert buf[5:].isnan().all()
    with pytest.raises(RuntimeError, match=r"out must be a contiguous float32 CPU tensor \[M, N\]"):
        layer.matmul(x, buf[:4])


def test_zero_rows_and_all_zero_blocks() -> None:
    w, _, x = case(m=3)
    x[1] = 0  # amax 0: the block's scale is 0, the row's output is exactly the bias
    layer = Q4Linear(w, torch.arange(70.0))
    y = layer(x)
    assert torch.equal(y[1], torch.arange(70.0))
    assert layer(x[:0]).shape == (0, 70)


def test_fused_q_k_v_and_gate_up_give_the_same_bits() -> None:
    from torch import nn

    from specserve.models.layers.lowbit_fused import FusedPart, fuse_lowbit

    g = torch.Generator().manual_seed(3)

    def lin(cls: type, n: int, k: int, bias: bool) -> nn.Module:
        w = torch.randn(n, k, generator=g)
        return cls(w, torch.randn(n, generator=g) if bias else None)

    attn, mlp, mixed = nn.Module(), nn.Module(), nn.Module()
    attn.q, attn.k, attn.v = (
        lin(Q8Linear, 64, 96, True),
        lin(Q8Linear, 16, 96, False),
        lin(Q8Linear, 16, 96, True),
    )
    mlp.gate, mlp.up = lin(Q4Linear, 40, 96, False), lin(Q4Linear, 40, 96, False)
    # parts of different kinds share a call too (GGUF files mix them); 70 outputs cannot
    mixed.gate, mixed.up = lin(Q4Linear, 40, 96, False), lin(Q5Linear, 40, 96, True)
    mixed.q, mixed.k, mixed.v = (
        lin(Q5Linear, 64, 96, True),
        lin(Q5Linear, 16, 96, True),
        lin(Q6Linear, 16, 96, True),  # the 1.5B's v is Q6_K beside Q4_K q and k
    )
    odd = nn.Module()
    odd.gate, odd.up = lin(Q8Linear, 70, 96, False), lin(Q8Linear, 40, 96, False)
    model = nn.ModuleList([attn, mlp, mixed, odd])
    x = torch.randn(5, 96, generator=g)
    names = [
        (attn, "q"),
        (attn, "k"),
        (attn, "v"),
        (mlp, "gate"),
        (mlp, "up"),
        (mixed, "gate"),
        (mixed, "up"),
        (mixed, "q"),
        (mixed, "k"),
        (mixed, "v"),
        (odd, "gate"),
        (odd, "up"),
    ]
    before = [getattr(m, n)(x) for m, n in names]
    assert fuse_lowbit(model) == 4
    assert isinstance(attn.q, FusedPart) and isinstance(mlp.up, FusedPart)
    assert isinstance(mixed.gate, FusedPart) and isinstance(mixed.v, FusedPart)
    assert isinstance(odd.gate, Q8Linear)
    for (m, n), want in zip(names, before, strict=True):
        assert torch.equal(getattr(m, n)(x), want), n
    # a new input is computed afresh, also when only a later part is asked, and a part asked
    # again (not the next one of a pass) does not reuse outputs of an input changed since
    y = torch.randn(2, 96, generator=g)
    assert torch.equal(attn.v(y), before_v := attn.v(y)) and before_v.shape == (2, 16)
    q1 = attn.q(y).clone()
    y.mul_(2)
    assert not torch.equal(attn.q(y), q1)


@pytest.mark.skipif(len(kernel_isas()) < 2, reason="this CPU has only AVX2: one instruction set")
@pytest.mark.parametrize("cls", KINDS)
def test_every_instruction_set_gives_the_same_bits(cls: type) -> None:
    # the VNNI dots are the same integers (q8 by way of x + 128, q6 and q4k's sub-scales by
    # 32-bit multiplies) and the float steps shared
    layer, x = any_kind(cls)
    got = {}
    try:
        for name in kernel_isas():
            kernel_isa(name)
            got[name] = layer(x)
    finally:
        kernel_isa("auto")
    first = got.pop("avx2")
    for name, y in got.items():
        assert torch.equal(y, first), (name, (y - first).abs().max())


def test_unknown_instruction_set_is_refused() -> None:
    with pytest.raises(RuntimeError, match="want '', 'auto', 'avx2' or 'avx512vnni', got 'sse'"):
        kernel_isa("sse")
    assert kernel_isa("") == kernel_isa("auto")


@pytest.mark.skipif(len(kernel_isas()) < 2, reason="this CPU has only AVX2: nothing to choose")
def test_the_environment_can_ask_for_avx2() -> None:
    import os
    import subprocess
    import sys

    code = "from specserve.models.layers.lowbit import kernel_isa; print(kernel_isa())"
    env = {**os.environ, "SPECSERVE_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "avx2", out.stderr
