"""The low-bit kernels on GGUF's k-quant layouts (q4k, q6k): records of 256 inputs, x scaled
per 256, the block dots summed as integers under one float step."""

from __future__ import annotations

import pytest
import torch

from specserve.models.layers.lowbit import Q4KLinear, Q6KLinear, Q6Linear, Q8Linear
from specserve.ops.cpu.build import problem
from tests.models.lowbit_cases import q4k_layer, q6k_groups, record_values, reference

pytestmark = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")


def test_q4k_records_hold_the_fields() -> None:
    layer = q4k_layer(n=70, k=512)
    assert layer.records.shape == (9, 2, 1184)  # 70 outputs: a padded last tile
    again = Q4KLinear.from_fields(*record_values(layer), None)
    assert torch.equal(again.records, layer.records)
    with pytest.raises(RuntimeError, match=r"records must be uint8 \[ceil\(N/8\), K/256, 1184\]"):
        layer.kernels.lowbit_linear(torch.randn(2, 256), [layer.records], [4], [70], None, None)


def test_q4k_kernel_computes_the_quantized_arithmetic(isa: str) -> None:
    layer = q4k_layer()
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    got, ref = layer(x).double(), reference(x, layer)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("threads", [1, 2])
def test_q4k_rows_do_not_depend_on_the_rows_beside_them(threads: int, isa: str) -> None:
    layer = q4k_layer()
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = layer(x)
        for m in (1, 2, 3, 4, 5, 7, 8, 13, 33):
            for start in (0, 1, 70 - m):
                assert torch.equal(layer(x[start : start + m]), full[start : start + m]), (m, start)
    finally:
        torch.set_num_threads(before)


def test_q4k_fuses_with_other_kinds() -> None:
    # the 1.5B's attention: q and k Q4_K, v Q6_K, one call
    from torch import nn

    from specserve.models.layers.lowbit_fused import fuse_lowbit

    attn = nn.Module()
    attn.q, attn.k = q4k_layer(64, 256, seed=3), q4k_layer(16, 256, seed=4, bias=False)
    attn.v = Q6KLinear.from_groups(*q6k_groups(16, 256, seed=5), None)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6))
    before = [attn.q(x), attn.k(x), attn.v(x)]
    assert fuse_lowbit(attn) == 1
    for got, want in zip([attn.q(x), attn.k(x), attn.v(x)], before, strict=True):
        assert torch.equal(got, want)


def test_q6k_records_hold_the_values_in_fewer_bytes() -> None:
    groups = q6k_groups(70, 1024, seed=7)
    layer, q6 = Q6KLinear.from_groups(*groups, None), Q6Linear.from_groups(*groups, None)
    assert layer.records.shape == (9, 4, 1680)  # d once per 256 inputs: 0.820 bytes a weight
    assert layer.records.numel() / q6.records.numel() == 1680 / (8 * 224)
    for got, want in zip(record_values(layer), groups, strict=True):
        assert torch.equal(got, want)
    q, d, sc = groups
    d = d.clone()
    d[0, 1] *= 2  # a block of 32 whose d is not its super-block's
    with pytest.raises(ValueError, match="one value per 256 inputs"):
        Q6KLinear.from_groups(q, d, sc, None)


def test_q6k_kernel_computes_the_quantized_arithmetic(isa: str) -> None:
    # q6's steps on x scaled per 256 inputs, the 8 block dots summed before d
    groups = q6k_groups(70, 1024, seed=8)
    bias = torch.randn(70, generator=torch.Generator().manual_seed(9))
    layer = Q6KLinear.from_groups(*groups, bias)
    x = torch.randn(9, 1024, generator=torch.Generator().manual_seed(10))
    got, ref = layer(x).double(), reference(x, layer)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("threads", [1, 2])
def test_q6k_rows_do_not_depend_on_the_rows_beside_them(threads: int, isa: str) -> None:
    layer = Q6KLinear.from_groups(*q6k_groups(70, 1024, seed=8), None)
    x = torch.randn(37, 1024, generator=torch.Generator().manual_seed(10))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = layer(x)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 16):
            for start in (0, 1, 37 - m):
                assert torch.equal(layer(x[start : start + m]), full[start : start + m]), (m, start)
    finally:
        torch.set_num_threads(before)


def test_x_scaled_per_256_and_per_32_do_not_share_a_call() -> None:
    # q4k/q6k want x scaled per 256 inputs, the block kinds per 32: fuse_lowbit keeps them
    # apart, and the kernel refuses a call that mixes them
    from torch import nn

    from specserve.models.layers.lowbit_fused import fuse_lowbit

    mlp = nn.Module()
    mlp.gate, mlp.up = q4k_layer(64, 256, seed=11), Q8Linear(torch.randn(64, 256), None)
    assert fuse_lowbit(mlp) == 0
    with pytest.raises(RuntimeError, match="q4k and q6k .* cannot share a call with q8"):
        mlp.up.kernels.lowbit_linear(
            torch.randn(2, 256), [mlp.gate.records, mlp.up.records], [4, 0], [64, 64], None, None
        )
