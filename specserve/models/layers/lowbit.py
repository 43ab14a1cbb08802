"""float32 linears on our own AVX2 low-bit kernels (ops/cpu/lowbit.cpp).

The weights stay in blocks of 32 inputs in memory (q8: int8 + one scale, 1.125 bytes per
weight; q4: 4-bit + scale and low, 0.75 bytes), so a decode step reads a quarter (q8) or
under a fifth (q4) of float32's bytes. The kernel quantizes each activation row to int8 per
block and runs the block dot products on integers, as llama.cpp does on CPUs. A row's
result never depends on the other rows of the call (the kernel's design;
tests/models/test_lowbit.py), so these layers are batch-invariant as they stand.

From a GGUF, Q8_0 weights come back exactly (dequantized Q8_0 values are d * q with d the
block's absmax / 127, which is what the requantization finds again); other types are
re-quantized from their float32 values.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.ops.cpu.build import load

GROUP = 32
TILE = 4  # outputs per record (ops/cpu/lowbit.cpp's layout)


def q8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> q: [N, K] int8, scale: [N, K/32] float32 (w ~ q * scale)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    scale = (g.abs().amax(dim=-1) / 127).clamp_min(1e-30)
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(n, k).contiguous(), scale.contiguous()


def int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] -> q: [N, K] int32 in 0..15, scale and low: [N, K/32] (w ~ q * scale + low)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    q = torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15)
    return q.to(torch.int32).view(n, k), scale, low


def q4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] -> packed: [N, K/2] uint8, scale and low: [N, K/32] (w ~ q * scale + low).
    A block's byte i holds element i (low nibble) and element i + 16 (high nibble)."""
    n, k = w.shape
    q, scale, low = int4_groups(w)
    g = q.to(torch.uint8).view(n, k // GROUP, GROUP)
    packed = g[..., : GROUP // 2] | (g[..., GROUP // 2 :] << 4)
    return packed.reshape(n, k // 2).contiguous(), scale.contiguous(), low.contiguous()


def tile_records(parts: list[torch.Tensor]) -> torch.Tensor:
    """Interleave per-block fields into the kernel's records.

    parts: [N, K/32, bytes] each (e.g. the scale as 4 bytes, then the block's weights) ->
    [ceil(N/4), K/32, 4 * sum(bytes)] uint8: for each tile of 4 outputs and each block, the
    first part of the 4 outputs, then the second part of the 4, and so on. N is padded with
    zero outputs."""
    n, nb = parts[0].shape[:2]
    pad = -n % TILE
    fields = []
    for part in parts:
        b = part.contiguous().view(torch.uint8).reshape(n, nb, -1)
        size = b.shape[-1]
        b = torch.cat([b, b.new_zeros(pad, nb, size)]) if pad else b
        fields.append(b.view(-1, TILE, nb, size).transpose(1, 2).reshape(-1, nb, TILE * size))
    return torch.cat(fields, dim=-1).contiguous()


def untile_records(records: torch.Tensor, n: int, sizes: list[int]) -> list[torch.Tensor]:
    """The inverse of tile_records: [N, K/32, size] uint8 for each field size in bytes."""
    t, nb, _ = records.shape
    out, at = [], 0
    for size in sizes:
        field = records[..., at : at + TILE * size].reshape(t, nb, TILE, size)
        out.append(field.transpose(1, 2).reshape(t * TILE, nb, size)[:n].contiguous())
        at += TILE * size
    return out


class LowbitLinear(nn.Module):
    """Common shape handling; subclasses hold the blocks and call their kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % GROUP:
            raise ValueError(f"low-bit kernels need in_features divisible by {GROUP}")
        self.kernels = load()
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), False)
        self.records: torch.Tensor  # the kernel's tiled blocks (a buffer, set by subclasses)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = self.matmul(rows.float())
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Q8Linear(LowbitLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        q, scale = q8_blocks(weight)
        nb = self.in_features // GROUP
        records = tile_records([scale[..., None], q.view(-1, nb, GROUP)])
        self.register_buffer("records", records)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K] int8, scale [N, K/32]) back from the records, as q8_blocks gave them."""
        scale, q = untile_records(self.records, self.out_features, [4, GROUP])
        return q.view(torch.int8).view(self.out_features, -1), scale.view(torch.float32)[..., 0]

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self.kernels.q8_linear(rows, self.records, self.out_features, self.bias)


class Q4Linear(LowbitLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        q, scale, low = q4_blocks(weight)
        nb = self.in_features // GROUP
        parts = [scale[..., None], low[..., None], q.view(-1, nb, GROUP // 2)]
        self.register_buffer("records", tile_records(parts))

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed [N, K/2] uint8, scale, low [N, K/32]) back from the records."""
        scale, low, q = untile_records(self.records, self.out_features, [4, 4, GROUP // 2])
        f32 = torch.float32
        return q.view(self.out_features, -1), scale.view(f32)[..., 0], low.view(f32)[..., 0]

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self.kernels.q4_linear(rows, self.records, self.out_features, self.bias)
