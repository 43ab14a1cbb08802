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


def q5_blocks(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w: [N, K] -> nibbles [N, K/2] uint8 (as q4_blocks packs them), high bits [N, K/32] int32
    (bit i: element i's fifth bit), scale and low [N, K/32]: w ~ q * scale + low, q 0..31.

    GGUF Q5_0's own rule: the element of largest magnitude m gets q = 0, so scale = -m / 16
    and low = -16 * scale; Q5_0 weights come back exactly."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    m = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))[..., 0]
    scale = -m / 16
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(g / safe[..., None] + 16).clamp(0, 31).to(torch.int32)
    nib = (q & 15).to(torch.uint8)
    packed = nib[..., : GROUP // 2] | (nib[..., GROUP // 2 :] << 4)
    bits = ((q >> 4) << torch.arange(GROUP, dtype=torch.int32)).sum(-1, dtype=torch.int64)
    high = (bits - (bits >= 2**31).long() * 2**32).to(torch.int32)  # as a signed 32-bit word
    low = -16 * scale
    return packed.reshape(n, k // 2).contiguous(), high.contiguous(), scale.contiguous(), low


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


def fifth_bit_planes(high: torch.Tensor) -> torch.Tensor:
    """[N, K/32] int32 words (bit i: element i's fifth bit) -> [ceil(N/4), K/32, 16] uint8:
    for each tile of 4 outputs, bit c of byte j is output c's element j and bit c + 4 its
    element j + 16 (the layout ops/cpu/lowbit.cpp's Q5 reads)."""
    n, nb = high.shape
    bits = (high.long()[..., None] >> torch.arange(GROUP)) & 1  # [N, nb, 32]
    bits = torch.cat([bits, bits.new_zeros(-n % TILE, nb, GROUP)])
    t = bits.view(-1, TILE, nb, GROUP)
    shift = torch.arange(TILE)[None, :, None, None]
    planes = (t[..., : GROUP // 2] << shift) | (t[..., GROUP // 2 :] << (shift + TILE))
    return planes.sum(1).to(torch.uint8)


def words_from_planes(planes: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of fifth_bit_planes: [N, K/32] int32 words."""
    t, nb, _ = planes.shape
    c = torch.arange(TILE)[None, :, None, None]
    p = planes.long()[:, None]  # [T, 1, nb, 16]
    bits = torch.cat([(p >> c) & 1, (p >> (c + TILE)) & 1], dim=-1)  # [T, 4, nb, 32]
    words = (bits << torch.arange(GROUP)).sum(-1).reshape(t * TILE, nb)[:n]
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


class Q5Linear(LowbitLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        q, high, scale, low = q5_blocks(weight)
        nb = self.in_features // GROUP
        records = tile_records([scale[..., None], low[..., None], q.view(-1, nb, GROUP // 2)])
        self.register_buffer("records", torch.cat([records, fifth_bit_planes(high)], dim=-1))

    def blocks(self) -> tuple[torch.Tensor, ...]:
        """(nibbles [N, K/2], high bits [N, K/32] int32, scale, low) back from the records."""
        n, sizes = self.out_features, [4, 4, GROUP // 2]
        scale, low, q = untile_records(self.records[..., : TILE * sum(sizes)], n, sizes)
        high = words_from_planes(self.records[..., TILE * sum(sizes) :], n)
        f32 = torch.float32
        return q.view(n, -1), high, scale.view(f32)[..., 0], low.view(f32)[..., 0]

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self.kernels.q5_linear(rows, self.records, self.out_features, self.bias)


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
        self.inner = type(first).__new__(type(first))
        nn.Module.__init__(self.inner)
        self.inner.in_features = first.in_features
        self.inner.out_features = sum(p.out_features for p in parts)
        self.inner.kernels = first.kernels
        self.inner.register_buffer("records", torch.cat([p.records for p in parts]))
        biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        has_bias = any(p.bias is not None for p in parts)
        self.inner.bias = nn.Parameter(torch.cat(biases), False) if has_bias else None
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
