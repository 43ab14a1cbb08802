"""float32 RMSNorm and rotary on the CPU kernels (ops/cpu/pointwise.cpp) against the float64
torch formulas, and row by row: a row's result does not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

from specserve.models.layers.basic import RMSNorm, RotaryEmbedding, apply_rotary
from specserve.ops.cpu.build import problem

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
