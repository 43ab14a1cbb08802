"""Reference low-bit linears: the arithmetic of ops/cpu/lowbit.cpp, written plainly.

A weight matrix [N, K] is kept in blocks of 32 inputs, one kind of block per matrix:

    kind  number  weight of block b, input i                   the file it mirrors
    q8    0       s * q,             q int8                     GGUF Q8_0
    q4    1       s * q + low,       q 0..15                    -
    q5    2       s * (q - 16),      q 0..31                    GGUF Q5_0
    q6    3       d * sc * (q - 32), q 0..63, sc int8 per 16    GGUF Q6_K's values
    q4k   4       d * sc * q - dmin * m, q 0..15, sc and m 0..63 per block,
                  d and dmin per 256 inputs                     GGUF Q4_K
    q6k   5       q6 with d per 256 inputs                      GGUF Q6_K

s, low, d and dmin are float16 values. The kernel first quantizes each row of x to int8,
with one scale per 32 inputs (per 256 for q4k and q6k, as llama.cpp's Q8_K), then takes
each block's dot product with the weights' integers exactly, and only then meets the float
scales: per record (a block, or q4k's and q6k's 256 inputs), in order,
acc = fma(float(dot), scale * d_x, acc), with q4's and q4k's lows as fmas of their own.

The records the kernels read (ops/fast/lowbit.py writes them) hold 8 outputs by one record
of inputs each, stored [tile of 8 outputs][record][bytes], the last tile padded with zero
outputs. A *step* is 4 consecutive inputs of each of the tile's 8 outputs: 32 bytes, output
o's 4 inputs at bytes 4o .. 4o + 3 (`_step_and_byte`). Fields in record order:

    q8   s[8] float16; q + 128 as uint8, 8 steps                                272 bytes
    q4   s[8], low[8] float16; 4 nibble arrays: array i's bytes hold step 2i
         in their low nibble and step 2i + 1 in their high one                  160 bytes
    q5   s[8]; q4's nibble arrays (q's low 4 bits); one plane of 32 bytes:
         bit j of byte p is bit 4 of step j's byte p                            176 bytes
    q6   d[8]; sc int8 [2 halves][8]; q4's nibble arrays; two planes: bits
         2j, 2j + 1 of plane h's byte p are the top bits of step 4h + j's       224 bytes
    q4k  per 256 inputs: d[8], dmin[8] float16; sc and m uint8 [8 blocks][8];
         then each block's q4 nibble arrays                                     1184 bytes
    q6k  per 256 inputs: d[8]; then each block's q6 record less its d           1680 bytes

This module reads the records with those formulas, an index per byte, so a test of the
fast writer against it checks the layout; `lowbit_linear` gives the kernel's output from
them: its own float32 bits, or in float64 the exact value it approximates. The weight
quantizers here are the ones the layers use (at load only: nothing faster is needed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

GROUP = 32  # inputs per block
SUPER = 256  # inputs per q4k / q6k record (GGUF k-quants' super-blocks)
PER = SUPER // GROUP  # blocks in a q4k / q6k record
SUB = 16  # inputs per q6 sub-scale
TILE = 8  # outputs per record
STEP = 4  # inputs per step
FIELD = 2 * TILE  # bytes of a record's float16 field
Q8_SHIFT = 0x80  # q8 records hold q + 128: VNNI's unsigned operand
Q8, Q4, Q5, Q6, Q4K, Q6K = range(6)  # the kernel's kind numbers
X_GROUP = {Q8: GROUP, Q4: GROUP, Q5: GROUP, Q6: GROUP, Q4K: SUPER, Q6K: SUPER}


def half_values(v: torch.Tensor, rounding: str = "nearest") -> torch.Tensor:
    """float32 values rounded to float16 ("down" / "up": to the float16 at or below / above),
    returned as float32; an error names the problem if one does not fit float16."""
    h = v.half()
    if rounding != "nearest":
        off = h.float() > v if rounding == "down" else h.float() < v
        towards = torch.full_like(h, float("-inf") if rounding == "down" else float("inf"))
        h = torch.where(off, torch.nextafter(h, towards), h)
    if not torch.isfinite(h).all():
        raise ValueError("weights too large for float16 block scales; use --weights dequant")
    return h.float()


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """scale with zeros (all-zero or constant blocks) replaced by 1: their q is 0 anyway."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def q8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> q: [N, K] int8, scale: [N, K/32] float32 holding float16 values
    (w ~ q * scale)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    scale = half_values(g.abs().amax(dim=-1) / 127)
    q = torch.round(g / _safe(scale)[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(n, k).contiguous(), scale.contiguous()


def int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] -> q: [N, K] int32 in 0..15, scale and low: [N, K/32] float16 values
    (w ~ q * scale + low). low is rounded down and scale up, so the 16 levels still span the
    block and every weight rounds to within half a step."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    low = half_values(g.amin(dim=-1), "down")
    scale = half_values((g.amax(dim=-1) - low) / 15, "up")
    q = torch.round((g - low[..., None]) / _safe(scale)[..., None]).clamp(0, 15)
    return q.to(torch.int32).view(n, k), scale, low


def int5_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] -> q: [N, K] int32 in 0..31, scale and low: [N, K/32] (w ~ q * scale + low).

    GGUF Q5_0's own rule: the element of largest magnitude m gets q = 0, so scale = -m / 16
    (as float16) and low = -16 * scale; Q5_0 weights come back exactly."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    m = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))[..., 0]
    scale = half_values(-m / 16)
    q = torch.round(g / _safe(scale)[..., None] + 16).clamp(0, 31).to(torch.int32)
    return q.view(n, k), scale.contiguous(), -16 * scale


def int6_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] -> q: [N, K] int32 in 0..63, d: [N, K/32] float16 values, sc: [N, K/16] int8
    (w ~ d * sc * (q - 32)): Q6_K's form with a block of 32 where it has 256. Each 16 inputs'
    step s = max|w| / 31 becomes d * sc, d (rounded up) giving the larger one sc = 127."""
    n, k = w.shape
    sub = w.float().view(n, k // GROUP, 2, SUB)
    step = sub.abs().amax(dim=-1) / 31  # [N, K/32, 2]
    d = half_values(step.amax(dim=-1) / 127, "up")
    sc = torch.round(step / _safe(d)[..., None]).clamp(0, 127)
    q = torch.round(sub / _safe(d[..., None] * sc)[..., None]).clamp(-32, 31) + 32
    return q.to(torch.int32).view(n, k), d, sc.to(torch.int8).view(n, k // SUB)


def quantize_x(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> q [M, K/32, 32] int8 and d [M, K/32] float32, x ~ d * q, with one
    scale per `group` inputs (32, or 256 for q4k and q6k; repeated per block): d = max|x| / 127
    and q = x * (127 / max|x|) rounded half to even, in float32, as the kernel does."""
    g = x.float().view(x.shape[0], -1, group)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None]).to(torch.int8)
    d = (amax / 127).repeat_interleave(group // GROUP, dim=1)
    return q.view(x.shape[0], -1, GROUP), d


# Reading records [T, R, bytes] (T tiles, R records along K) back into values per output.


def _step_and_byte() -> tuple[torch.Tensor, torch.Tensor]:
    """[8 outputs, 32 inputs] of a block: the step an input is in, and its byte in the step."""
    o, i = torch.meshgrid(torch.arange(TILE), torch.arange(GROUP), indexing="ij")
    return i // STEP, o * STEP + i % STEP


def _per_output(v: torch.Tensor, n: int) -> torch.Tensor:
    """[T, R, 8, ...] by tile and output in it -> [N, R * ...], the padding dropped."""
    t, r = v.shape[:2]
    return v.transpose(1, 2).reshape(t * TILE, r, -1)[:n].reshape(n, -1)


def _halves(rec: torch.Tensor, at: int, n: int) -> torch.Tensor:
    """The float16 field at byte `at` of each record -> [N, R] float32."""
    return _per_output(rec[..., at : at + FIELD].contiguous().view(torch.float16).float(), n)


def _bytes(rec: torch.Tensor, at: int, n: int) -> torch.Tensor:
    """The 8-byte field at `at` (an unsigned byte per output) -> [N, R] int32."""
    return _per_output(rec[..., at : at + TILE].to(torch.int32), n)


def _step_bytes(rec: torch.Tensor, at: int) -> torch.Tensor:
    """8 steps of 32 bytes from `at` -> [T, R, 8, 32] int32: each output's 32 inputs."""
    step, byte = _step_and_byte()
    return rec[..., at + 32 * step + byte].to(torch.int32)


def _nibbles(rec: torch.Tensor, at: int) -> torch.Tensor:
    """4 nibble arrays from `at` -> [T, R, 8, 32] in 0..15: step s in array s // 2, in its
    low nibble for even s, its high one for odd."""
    step, byte = _step_and_byte()
    arrays = rec[..., at + 32 * (step // 2) + byte].long()
    return ((arrays >> (4 * (step % 2))) & 15).int()


def _plane_bits(rec: torch.Tensor, at: int, bits: int) -> torch.Tensor:
    """`bits` planes of 32 bytes from `at` -> [T, R, 8, 32]: step s's `bits` bits sit in plane
    s // (8 / bits), at bit bits * (s % (8 / bits)) of the byte."""
    step, byte = _step_and_byte()
    per = 8 // bits  # steps per plane
    planes = rec[..., at + 32 * (step // per) + byte].long()
    return ((planes >> (bits * (step % per))) & (2**bits - 1)).int()


def read_q8(rec: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """q8 records -> (q [N, K] int8, s [N, K/32]), as q8_blocks gives them."""
    q = (_step_bytes(rec, FIELD) ^ Q8_SHIFT).to(torch.uint8).view(torch.int8)
    return _per_output(q, n), _halves(rec, 0, n)


def read_q4(rec: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """q4 records -> (q [N, K] int32, s, low [N, K/32]), as int4_groups gives them."""
    return _per_output(_nibbles(rec, 2 * FIELD), n), _halves(rec, 0, n), _halves(rec, FIELD, n)


def read_q5(rec: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """q5 records -> (q [N, K] int32, s, low = -16 s [N, K/32]), as int5_groups gives them."""
    q = _nibbles(rec, FIELD) + 16 * _plane_bits(rec, FIELD + 128, 1)
    s = _halves(rec, 0, n)
    return _per_output(q, n), s, -16 * s


def _q6_block(rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A q6 record less its d (sc, nibble arrays, planes) -> q [T, R, 8, 32] int32 and sc
    [T, R, 8, 2] int32 (half h's sc at byte 8h + o)."""
    q = _nibbles(rec, FIELD) + 16 * _plane_bits(rec, FIELD + 128, 2)
    sc = rec[..., :FIELD].contiguous().view(torch.int8).to(torch.int32)
    return q, sc.view(*sc.shape[:-1], 2, TILE).transpose(-1, -2)


def read_q6(rec: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """q6 records -> (q [N, K] int32, d [N, K/32], sc [N, K/16] int8), as int6_groups."""
    q, sc = _q6_block(rec[..., FIELD:])
    return _per_output(q, n), _halves(rec, 0, n), _per_output(sc, n).to(torch.int8)


def read_q6k(rec: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """q6k records -> (q [N, K] int32, d [N, K/32] (each 256 inputs' d, repeated), sc
    [N, K/16] int8), as loading/q6k.py q6k_groups gives them."""
    t, r = rec.shape[:2]
    blocks = rec[..., FIELD:].reshape(t, r * PER, -1)  # block j: its q6 record less d
    q, sc = _q6_block(blocks)
    d = _halves(rec, 0, n).repeat_interleave(PER, dim=1)
    return _per_output(q, n), d, _per_output(sc, n).to(torch.int8)


def read_q4k(rec: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """q4k records -> (q [N, K], sc, m [N, K/32] int32, d, dmin [N, K/256]), as
    loading/q4k.py q4k_fields gives them."""
    t, r = rec.shape[:2]
    sc = [_bytes(rec, 2 * FIELD + TILE * b, n) for b in range(PER)]
    m = [_bytes(rec, 2 * FIELD + TILE * (PER + b), n) for b in range(PER)]
    nibbles = rec[..., 2 * FIELD + 2 * TILE * PER :].reshape(t, r * PER, -1)
    return (
        _per_output(_nibbles(nibbles, 0), n),
        torch.stack(sc, dim=-1).view(n, -1),
        torch.stack(m, dim=-1).view(n, -1),
        _halves(rec, 0, n),
        _halves(rec, FIELD, n),
    )


READERS = {Q8: read_q8, Q4: read_q4, Q5: read_q5, Q6: read_q6, Q4K: read_q4k, Q6K: read_q6k}


# The reference dot: each kind's float steps as (a, b) pairs, acc = fma(a, b, acc), in the
# kernel's order, computed in `dt` (float32 as the kernel rounds them, or float64 exactly).

Steps = list[tuple[torch.Tensor, torch.Tensor]]


class QuantizedX(NamedTuple):
    """x's rows as the kernel holds them: q [M, K/32, 32] int8, and per block d (x ~ d * q)
    and sum = d * sum(q) (float32, the factor of a block's low), [M, K/32]."""

    q: torch.Tensor
    d: torch.Tensor
    sum: torch.Tensor


def _dots(x: QuantizedX, q: torch.Tensor, size: int = GROUP) -> torch.Tensor:
    """x's and q's [N, K] exact integer dots per `size` inputs -> [M, N, K/size] (float64:
    exact, as the products and sums fit its 53 bits)."""
    qx = x.q.reshape(x.q.shape[0], -1, size).double()
    return torch.einsum("mbj,nbj->mnb", qx, q.reshape(q.shape[0], -1, size).double())


def _per_block(dots: torch.Tensor, s: torch.Tensor, x: QuantizedX, dt: torch.dtype) -> Steps:
    """One float step a block: acc = fma(float(dot), s * d_x, acc); dots [M, N, B], s [N, B]."""
    scale = s.to(dt)[None] * x.d.to(dt)[:, None]
    return [(dots[..., b].to(dt), scale[..., b]) for b in range(dots.shape[-1])]


def _q8(rec: torch.Tensor, n: int, x: QuantizedX, dt: torch.dtype) -> Steps:
    q, s = read_q8(rec, n)
    return _per_block(_dots(x, q), s, x, dt)


def _q4(rec: torch.Tensor, n: int, x: QuantizedX, dt: torch.dtype) -> Steps:
    """Each block's step, then its low: acc = fma(low, d_x * sum(q_x), acc)."""
    q, s, low = read_q4(rec, n)
    steps = []
    for b, step in enumerate(_per_block(_dots(x, q), s, x, dt)):
        steps += [step, (low[None, :, b].to(dt), x.sum[:, None, b].to(dt))]
    return steps


def _q5(rec: torch.Tensor, n: int, x: QuantizedX, dt: torch.dtype) -> Steps:
    q, s, _ = read_q5(rec, n)
    return _per_block(_dots(x, q - 16), s, x, dt)


def _q6_dots(x: QuantizedX, q: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """sum over a block's two halves of sc * dot(q - 32, q_x), an integer -> [M, N, K/32]."""
    sub = _dots(x, q - 32, SUB) * sc.double()[None]
    return sub.view(*sub.shape[:2], -1, 2).sum(-1)


def _q6(rec: torch.Tensor, n: int, x: QuantizedX, dt: torch.dtype) -> Steps:
    q, d, sc = read_q6(rec, n)
    return _per_block(_q6_dots(x, q, sc), d, x, dt)


def _per_record(dots: torch.Tensor, d: torch.Tensor, x: QuantizedX, dt: torch.dtype) -> Steps:
    """One float step per 256 inputs: the 8 blocks' integer dots [M, N, K/32] summed, then
    acc = fma(float(sum), d * d_x, acc), d [N, K/256] and d_x one value there."""
    sums = dots.view(*dots.shape[:2], -1, PER).sum(-1)
    return _per_block(sums, d, x._replace(d=x.d[:, ::PER]), dt)


def _q6k(rec: torch.Tensor, n: int, x: QuantizedX, dt: torch.dtype) -> Steps:
    q, d, sc = read_q6k(rec, n)
    return _per_record(_q6_dots(x, q, sc), d[:, ::PER], x, dt)


def _q4k(rec: torch.Tensor, n: int, x: QuantizedX, dt: torch.dtype) -> Steps:
    """Per 256 inputs: each block's low, acc = fma(-(dmin * m), d_x * sum(q_x), acc), then
    the record's step over the blocks' sc * dot."""
    q, sc, m, d, dmin = read_q4k(rec, n)
    steps = []
    for r, step in enumerate(_per_record(_dots(x, q) * sc.double()[None], d, x, dt)):
        for b in range(r * PER, (r + 1) * PER):
            low = -(dmin[:, r].to(dt) * m[:, b].to(dt))
            steps.append((low[None], x.sum[:, None, b].to(dt)))
        steps.append(step)
    return steps


_STEPS: dict[int, Callable[[torch.Tensor, int, QuantizedX, torch.dtype], Steps]] = {
    Q8: _q8,
    Q4: _q4,
    Q5: _q5,
    Q6: _q6,
    Q4K: _q4k,
    Q6K: _q6k,
}


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once, as a vfmadd: a * b is exact in float64, and their sum
    rounded to odd in float64 rounds to float32 as the exact sum would (Boldo & Melquiond)."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    p_part = s - c64
    lost = (p - p_part) + (c64 - (s - p_part))  # p + c - s, exactly (Knuth's TwoSum)
    # where s is inexact, its odd neighbour on the exact sum's side: rounding to odd
    even = s.view(torch.int64) & 1 == 0
    towards = torch.where(lost > 0, torch.inf, -torch.inf).double()
    return torch.where((lost != 0) & even, torch.nextafter(s, towards), s).float()


def lowbit_linear(
    x: torch.Tensor,
    records: list[torch.Tensor],
    kinds: list[int],
    n_outs: list[int],
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """y [M, sum(n_outs)] = x [M, K] @ W^T (+ bias), W the records' matrices side by side, as
    the kernel's lowbit_linear. float32: the kernel's own bits; float64: the same integer dots
    with the float steps in float64, the value the kernel approximates."""
    parts = []
    for rec, kind, n in zip(records, kinds, n_outs, strict=True):
        q, d = quantize_x(x, X_GROUP[kind])
        qx = QuantizedX(q, d, q.sum(-1, dtype=torch.int32).float() * d)
        acc = torch.zeros((), dtype=dtype)
        for a, b in _STEPS[kind](rec, n, qx, dtype):
            acc = fma32(a, b, acc) if dtype == torch.float32 else acc + a * b
        parts.append(acc.expand(x.shape[0], n))
    y = torch.cat(parts, dim=1)
    return y + (bias.to(dtype) if bias is not None else 0.0)
