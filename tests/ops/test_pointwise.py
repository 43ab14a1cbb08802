"""float32 RMSNorm (alone and after the residual add), the gated MLP activations and rotary on
the CPU kernels (ops/cpu/pointwise.cpp) against the float64 torch formulas, and row by row: a
row's result does not depend on the rows beside it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from specserve.models.layers.basic import RMSNorm, RotaryEmbedding, add_norm, apply_rotary
from specserve.ops.cpu.build import kernels_for, problem

pytestmark = pytest.mark.skipif(problem() is not None, reason=f"CPU kernels: {problem()}")


def test_rms_norm_kernel() -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64, generator=g)
    x = torch.randn(3, 5, 64, generator=g) * 3
    got = norm(x)
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    assert (got.double() - want).abs().max().item() < 1e-5
    assert norm(x).shape == x.shape and got.dtype == torch.float32
    for i in range(3):
        assert torch.equal(norm(x[i : i + 1]), got[i : i + 1])


def test_rotary_kernel() -> None:
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(64, 10000.0)
    positions = torch.tensor([0, 5, 6, 300])
    cos, sin = rope.cos_sin(positions, torch.float32)
    x = torch.randn(4, 3, 64, generator=g)
    got = apply_rotary(x, cos, sin)
    # the torch formula (rotate halves) in float64
    x64, c64, s64 = x.double(), cos.double(), sin.double()
    rotated = torch.cat((-x64[..., 32:], x64[..., :32]), dim=-1)
    want = x64 * c64 + rotated * s64
    assert (got.double() - want).abs().max().item() < 1e-5
    # a non-contiguous view (a slice of a fused q/k/v output) gives the same result
    wide = torch.cat([x.reshape(4, -1), torch.randn(4, 7, generator=g)], dim=-1)
    assert torch.equal(apply_rotary(wide[:, :192].view(4, 3, 64), cos, sin), got)
    assert torch.equal(apply_rotary(x[2:3], cos[2:3], sin[2:3]), got[2:3])


def test_add_norm_is_the_add_then_the_norm_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64, generator=g)
    x, y = torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    s, n = add_norm(x, y, norm)
    assert torch.equal(s, x + y) and torch.equal(n, norm(x + y))
    # float64 takes the torch path: the same values
    s64, n64 = add_norm(x.double(), y.double(), copy.deepcopy(norm).double())
    assert (n.double() - n64).abs().max().item() < 1e-5
    assert torch.equal(add_norm(x[1:], y[1:], norm)[1], n[1:])


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_kernel(activation: str) -> None:
    g = torch.Generator().manual_seed(3)
    kernels = kernels_for(torch.zeros(1))
    assert kernels is not None
    # wide range: large |gate| exercises exp's clamp and both signs' formulas
    gate_up = torch.randn(6, 2 * 40, generator=g) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 90.0, -90.0, 200.0, -200.0])
    got = kernels.gated(gate_up, activation == "silu")
    g64, u64 = gate_up.double()[:, :40], gate_up.double()[:, 40:]
    if activation == "silu":
        act = torch.nn.functional.silu(g64)
    else:  # tanh-gelu as g * sigmoid(2y): torch's 1 + tanh(y) cancels to 0 for g < -6
        y = (2 / torch.pi) ** 0.5 * (g64 + 0.044715 * g64**3)
        act = g64 * torch.sigmoid(2 * y)
        close = torch.nn.functional.gelu(g64, approximate="tanh")
        assert (act - close).abs().max().item() < 1e-12
    want = act * u64
    # relative, but absolute far in the tail, where float32 y = O(10) leaves exp(-2y) ~1e-5 off
    assert ((got.double() - want).abs() <= 2e-6 * want.abs() + 1e-9).all()
    for i in range(6):
        assert torch.equal(kernels.gated(gate_up[i : i + 1], activation == "silu"), got[i : i + 1])
    with pytest.raises(RuntimeError, match="I a multiple of 8"):
        kernels.gated(torch.zeros(2, 20), True)


def test_top_softmax_is_the_k_largest_and_their_softmax_probabilities() -> None:
    kernels = kernels_for(torch.zeros(1))
    assert kernels is not None
    g = torch.Generator().manual_seed(3)
    for width in (8, 13, 16000, 16003):  # whole vectors and a scalar tail
        logits = torch.randn(3, width, generator=g) * 4
        for k in (1, 3):
            ids, probs = kernels.top_softmax(logits, k)
            want_p, want = torch.softmax(logits.double(), dim=-1).sort(descending=True)
            assert ids == want[:, :k].tolist()
            for got_row, want_row in zip(probs, want_p[:, :k].tolist(), strict=True):
                assert max(abs(a / b - 1) for a, b in zip(got_row, want_row, strict=True)) < 1e-5
            one = kernels.top_softmax(logits[1:2], k)  # a row alone: the same
            assert one == (ids[1:2], probs[1:2])
    # tied ones in index order; k past the row's width: all of it; a row of -inf: one entry
    # at probability 0
    tied = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0], [-float("inf")] * 5])
    ids, probs = kernels.top_softmax(tied, 9)
    assert ids == [[1, 3, 2, 4, 0], [0]] and probs[1] == [0.0]
    z = 2 + 2 * math.exp(-1) + math.exp(-2)
    want = [1 / z, 1 / z, math.exp(-1) / z, math.exp(-1) / z, math.exp(-2) / z]
    assert max(abs(a - b) for a, b in zip(probs[0], want, strict=True)) < 1e-6
    # a NaN is never picked
    assert kernels.top_softmax(torch.tensor([[0.0, float("nan"), 1.0]]), 2)[0] == [[2, 0]]


def test_rotary_tables_are_the_angles_of_each_position() -> None:
    """cos_sin's rows come from a table grown to cover the positions; every row is what the
    formula gives that position alone, before and after the table grows."""
    rope = RotaryEmbedding(64, 10000.0)

    def formula(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * rope.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    for positions in (torch.tensor([0, 5, 63]), torch.tensor([700, 6, 64]), torch.tensor([9000])):
        cos, sin = rope.cos_sin(positions, torch.float32, int(positions.max()) + 1)
        want_cos, want_sin = formula(positions)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    half, _ = rope.cos_sin(torch.tensor([3, 9000]), torch.bfloat16)  # `end` read from them
    assert half.dtype == torch.bfloat16 and torch.equal(
        half, formula(torch.tensor([3, 9000]))[0].bfloat16()
    )
