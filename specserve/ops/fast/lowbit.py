"""The low-bit kernels' records, written from a kind's values as whole-tensor reshapes.

The layout of every kind is in ops/naive/lowbit.py, which reads records back with its
formulas, one byte at a time; the tests hold this writer to that reader. Here the same
layout comes from views: `steps` puts a block's 32 inputs of 8 outputs into the kernel's
8 steps of 32 bytes, `nibble_steps` and `bit_planes` pack them, and the fields of a record
are concatenated in order. Loading a model runs this on every low-bit weight.
"""

from __future__ import annotations

import torch

from specserve.ops.naive.lowbit import FIELD, GROUP, Q8_SHIFT, STEP, SUPER, TILE


def tiled(t: torch.Tensor) -> torch.Tensor:
    """[N, R, ...] per-record values -> [ceil(N/8), R, 8, ...], padded with zero outputs."""
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, TILE, *t.shape[1:]).transpose(1, 2)


def steps(q: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [T, K/32, 8 steps, 32]: step j holds inputs 4j..4j+3 of each of a tile's
    8 outputs, output-major (the bytes one 256-bit load gives the kernel)."""
    n, k = q.shape
    t = tiled(q.reshape(n, k // GROUP, GROUP // STEP, STEP))  # [T, nb, out, step, 4]
    return t.transpose(2, 3).reshape(*t.shape[:2], GROUP // STEP, TILE * STEP)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[T, R, ...] of any dtype -> [T, R, bytes] uint8 (a record field)."""
    return t.contiguous().view(torch.uint8).reshape(*t.shape[:2], -1)


def scale_fields(*per_block: torch.Tensor) -> list[torch.Tensor]:
    """[N, R] values that float16 holds exactly (scale, low) -> their record fields."""
    return [as_bytes(tiled(v.half())) for v in per_block]


def nibble_steps(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] in 0..15 -> [T, K/32, 128] uint8: steps 2i, 2i+1 share a 32-byte array."""
    s = steps(q.to(torch.uint8))
    return as_bytes(s[:, :, 0::2] | (s[:, :, 1::2] << 4))


def bit_planes(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v: [N, K] of `bits` bits -> [T, K/32, 32 * bits] uint8: plane p (bytes 32p..) holds
    steps p * 8/bits .. of the block; step p * 8/bits + j's byte i sits at bits
    bits * j .. of the plane's byte i (q5's fifth bit: one plane; q6's top 2: two)."""
    s = steps(v.to(torch.uint8))  # [T, nb, 8, 32]
    per = GROUP // STEP // bits  # steps per plane
    shift = (bits * torch.arange(per, dtype=torch.uint8))[:, None]
    # the steps' bits do not overlap, so a sum is their bitwise or
    planes = [
        (s[:, :, p * per : (p + 1) * per] << shift).sum(2, dtype=torch.uint8) for p in range(bits)
    ]
    return torch.cat(planes, dim=-1)


def q8_records(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8, scale [N, K/32] holding float16 values -> q8 records."""
    # q + 128 as unsigned bytes: the VNNI kernels' unsigned operand (the AVX2 ones undo it)
    return torch.cat([*scale_fields(scale), as_bytes(steps(q)) ^ Q8_SHIFT], dim=-1)


def q4_records(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15, scale and low [N, K/32] holding float16 values -> q4 records."""
    return torch.cat([*scale_fields(scale, low), nibble_steps(q)], dim=-1)


def q5_records(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..31, scale [N, K/32] holding float16 values -> q5 records (low = -16
    scale is the kernel's own offset)."""
    return torch.cat([*scale_fields(scale), nibble_steps(q & 15), bit_planes(q >> 4, 1)], dim=-1)


def q6_records(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..63, d [N, K/32] holding float16 values, sc [N, K/16] int8 -> q6
    records."""
    n, k = q.shape
    sub = as_bytes(tiled(sc.to(torch.int8).view(n, k // GROUP, 2)).transpose(2, 3))
    fields = [*scale_fields(d), sub, nibble_steps(q & 15), bit_planes(q >> 4, 2)]
    return torch.cat(fields, dim=-1)


def q6k_records(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """q6's values with d [N, K/32] one value per 256 inputs, repeated (as loading/q6k.py
    gives it) -> q6k records: d once, then each block's q6 record less its d."""
    n, k = q.shape
    blocks = SUPER // GROUP
    per_super = d.view(n, k // SUPER, blocks)
    if not torch.equal(per_super, per_super[..., :1].expand_as(per_super)):
        raise ValueError("q6k: d must be one value per 256 inputs")
    r = q6_records(q, d, sc)
    r = r.view(r.shape[0], r.shape[1] // blocks, blocks, -1)
    return torch.cat([r[:, :, 0, :FIELD], r[..., FIELD:].flatten(2)], dim=-1)


def q4k_records(
    q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> torch.Tensor:
    """q [N, K] in 0..15; sc, m [N, K/32] in 0..63; d, dmin [N, K/256] holding float16
    values -> q4k records [ceil(N/8), K/256, 1184]."""
    supers = q.shape[1] // SUPER

    def per_super(t: torch.Tensor) -> torch.Tensor:  # [T, K/32, ...] -> [T, K/256, bytes]
        return t.reshape(t.shape[0], supers, -1)

    ints = [per_super(as_bytes(tiled(v.to(torch.uint8)))) for v in (sc, m)]
    return torch.cat([*scale_fields(d, dmin), *ints, per_super(nibble_steps(q))], dim=-1)
