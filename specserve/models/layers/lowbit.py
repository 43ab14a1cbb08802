"""float32 linears on our own AVX2 low-bit kernels (ops/cpu/lowbit.cpp).

The weights stay in blocks of 32 inputs in memory (q8: int8 + one scale, 1.125 bytes per
weight; q5: 5-bit + scale and low, 0.875; q4: 4-bit + scale and low, 0.75), stored as the
kernel's records of 4 outputs x one block (`tile_records`), so a decode step reads under a
third of float32's bytes in one sequential stream. The kernel quantizes each activation row
to int8 per block and runs the block dot products on integers, as llama.cpp does on CPUs. A
row's result never depends on the other rows of the call (the kernel's design;
tests/models/test_lowbit.py), so these layers are batch-invariant as they stand.

From a GGUF, Q8_0 (on q8) and Q5_0 (on q5) weights come back exactly: the requantization
finds their scales again. Other types are re-quantized from their float32 values.
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


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] in 0..15 -> [N, K/2] uint8: a block's byte i holds element i (low nibble)
    and element i + 16 (high nibble)."""
    n, k = q.shape
    g = q.to(torch.uint8).view(n, k // GROUP, GROUP)
    return (g[..., : GROUP // 2] | (g[..., GROUP // 2 :] << 4)).reshape(n, k // 2).contiguous()


def q4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] -> packed: [N, K/2] uint8 (pack_nibbles), scale and low: [N, K/32]
    (w ~ q * scale + low)."""
    q, scale, low = int4_groups(w)
    return pack_nibbles(q), scale.contiguous(), low.contiguous()


def q5_blocks(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w: [N, K] -> nibbles [N, K/2] uint8 (pack_nibbles of the low 4 bits), fifth bits
    [N, K/32, 32] uint8 (0 or 1), scale and low [N, K/32]: w ~ q * scale + low, q 0..31.

    GGUF Q5_0's own rule: the element of largest magnitude m gets q = 0, so scale = -m / 16
    and low = -16 * scale; Q5_0 weights come back exactly."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    m = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))[..., 0]
    scale = -m / 16
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(g / safe[..., None] + 16).clamp(0, 31).to(torch.int32)
    fifth = (q >> 4).to(torch.uint8)
    return pack_nibbles((q & 15).view(n, k)), fifth, scale.contiguous(), -16 * scale


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
    """Shape handling and the kernel call; subclasses quantize the weights into records."""

    KERNEL = ""  # the kernel's name in ops/cpu/module.cpp
    records: torch.Tensor  # the kernel's tiled blocks (a buffer)

    def __init__(
        self, records: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.kernels = load()
        self.register_buffer("records", records)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), False)

    @staticmethod
    def blocks_of(weight: torch.Tensor) -> int:
        """Blocks of 32 per output row (a clear error when in_features does not divide)."""
        if weight.shape[1] % GROUP:
            raise ValueError(f"low-bit kernels need in_features divisible by {GROUP}")
        return weight.shape[1] // GROUP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = self.matmul(rows.float())
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        kernel = getattr(self.kernels, self.KERNEL)
        return kernel(rows, self.records, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Q8Linear(LowbitLinear):
    KERNEL = "q8_linear"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        nb = self.blocks_of(weight)
        q, scale = q8_blocks(weight)
        records = tile_records([scale[..., None], q.view(-1, nb, GROUP)])
        super().__init__(records, weight.shape[0], weight.shape[1], bias)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K] int8, scale [N, K/32]) back from the records, as q8_blocks gave them."""
        scale, q = untile_records(self.records, self.out_features, [4, GROUP])
        return q.view(torch.int8).view(self.out_features, -1), scale.view(torch.float32)[..., 0]


class Q4Linear(LowbitLinear):
    KERNEL = "q4_linear"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        nb = self.blocks_of(weight)
        q, scale, low = q4_blocks(weight)
        parts = [scale[..., None], low[..., None], q.view(-1, nb, GROUP // 2)]
        super().__init__(tile_records(parts), weight.shape[0], weight.shape[1], bias)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed [N, K/2] uint8, scale, low [N, K/32]) back from the records."""
        scale, low, q = untile_records(self.records, self.out_features, [4, 4, GROUP // 2])
        f32 = torch.float32
        return q.view(self.out_features, -1), scale.view(f32)[..., 0], low.view(f32)[..., 0]


def fifth_bit_planes(fifth: torch.Tensor) -> torch.Tensor:
    """[N, K/32, 32] fifth bits -> [ceil(N/4), K/32, 16] uint8: for each tile of 4 outputs,
    bit c of byte j is output c's element j and bit c + 4 its element j + 16 (the layout
    ops/cpu/lowbit.cpp's Q5 reads)."""
    n, nb, _ = fifth.shape
    t = torch.cat([fifth, fifth.new_zeros(-n % TILE, nb, GROUP)]).view(-1, TILE, nb, GROUP)
    shift = torch.arange(TILE, dtype=torch.uint8)[None, :, None, None]
    planes = (t[..., : GROUP // 2] << shift) | (t[..., GROUP // 2 :] << (shift + TILE))
    return planes.sum(1, dtype=torch.uint8)  # the 4 outputs' bits do not overlap


def fifth_bits_from_planes(planes: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of fifth_bit_planes: [N, K/32, 32] uint8 bits."""
    t, nb, _ = planes.shape
    c = torch.arange(TILE, dtype=torch.uint8)[None, :, None, None]
    p = planes[:, None]  # [T, 1, nb, 16]
    bits = torch.cat([(p >> c) & 1, (p >> (c + TILE)) & 1], dim=-1)  # [T, 4, nb, 32]
    return bits.reshape(t * TILE, nb, GROUP)[:n]


class Q5Linear(LowbitLinear):
    KERNEL = "q5_linear"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        nb = self.blocks_of(weight)
        q, fifth, scale, low = q5_blocks(weight)
        records = tile_records([scale[..., None], low[..., None], q.view(-1, nb, GROUP // 2)])
        records = torch.cat([records, fifth_bit_planes(fifth)], dim=-1)
        super().__init__(records, weight.shape[0], weight.shape[1], bias)

    def blocks(self) -> tuple[torch.Tensor, ...]:
        """(nibbles [N, K/2], fifth bits [N, K/32, 32], scale, low) back from the records."""
        n, sizes = self.out_features, [4, 4, GROUP // 2]
        scale, low, q = untile_records(self.records[..., : TILE * sum(sizes)], n, sizes)
        fifth = fifth_bits_from_planes(self.records[..., TILE * sum(sizes) :], n)
        f32 = torch.float32
        return q.view(n, -1), fifth, scale.view(f32)[..., 0], low.view(f32)[..., 0]


class FusedLowbit(nn.Module):
    """Low-bit linears that read the same input (q/k/v, gate/up) run as one kernel call.

    Each call has a fixed cost (~30 us: quantizing x, starting threads), a large share of a
    small matrix's time, so one call for three saves two. The parts stay in the model as
    `FusedPart`s, so the model code is the same in every weight mode: the first part called
    with an input computes all outputs, the parts after it in the same pass slice them. The
    outputs are bit-identical to the separate layers' (an output's arithmetic depends only on
    its own records and x; every part's out_features is a multiple of the tile, so no tile
    straddles two parts).
    """

    def __init__(self, parts: list[LowbitLinear]) -> None:
        super().__init__()
        first = parts[0]
        biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        has_bias = any(p.bias is not None for p in parts)
        # one layer of the parts' kind over their records, stacked (no re-quantization)
        self.inner = type(first).__new__(type(first))
        LowbitLinear.__init__(
            self.inner,
            torch.cat([p.records for p in parts]),
            sum(p.out_features for p in parts),
            first.in_features,
            torch.cat(biases) if has_bias else None,
        )
        self.bounds = [0]
        for p in parts:
            self.bounds.append(self.bounds[-1] + p.out_features)
        # (input, all outputs, the part that may use them next)
        self._last: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:
        last = self._last
        # reuse only for the next parts of one pass (q, k, v in order) over the same input
        # object (kept alive by the memo); any other call computes afresh
        if last is None or last[0] is not x or i < last[2]:
            last = (x, self.inner(x), i)
        self._last = (x, last[1], i + 1) if i + 1 < len(self.bounds) - 1 else None
        return last[1][..., self.bounds[i] : self.bounds[i + 1]]


class FusedPart(nn.Module):
    """Part i of a FusedLowbit (stands where the separate linear was)."""

    def __init__(self, fused: FusedLowbit, i: int, like: LowbitLinear) -> None:
        super().__init__()
        self.fused = [fused]  # a list: the fused module is registered once, on the parent
        self.i, self.in_features, self.out_features = i, like.in_features, like.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused[0].part(self.i, x)


# children that read the same input, in the order the models call them
FUSE_GROUPS = (("q", "k", "v"), ("gate", "up"))


def fuse_lowbit(model: nn.Module) -> int:
    """Fuse each group of same-kind low-bit linears in `model`, in place; returns the count."""
    n = 0
    for module in list(model.modules()):
        for names in FUSE_GROUPS:
            parts = [getattr(module, name, None) for name in names]
            if not _fusable(parts):
                continue
            fused = FusedLowbit(parts)  # type: ignore[arg-type]
            module.add_module("_".join(names), fused)
            for i, (name, part) in enumerate(zip(names, parts, strict=True)):
                setattr(module, name, FusedPart(fused, i, part))  # type: ignore[arg-type]
            n += 1
    return n


def _fusable(parts: list[nn.Module | None]) -> bool:
    first = parts[0]
    if not isinstance(first, LowbitLinear):
        return False
    return all(
        type(p) is type(first)
        and isinstance(p, LowbitLinear)
        and p.in_features == first.in_features
        and p.out_features % TILE == 0
        for p in parts
    )
