"""float32 linears on our own AVX2 low-bit kernels (ops/cpu/lowbit.cpp).

The weights stay in blocks of 32 inputs in memory (q8: int8 + one scale, 1.0625 bytes per
weight; q6: 6-bit + an int8 scale per 16 and a scale, 0.875; q5: 5-bit + scale, 0.6875; q4:
4-bit + scale and low, 0.625; q4k: GGUF Q4_K's own fields, 0.578; scales are float16, as in
GGUF), stored as the kernel's records of 8 outputs x one block (see `steps`), so a decode step
reads under a third of float32's bytes in one sequential stream. The kernel quantizes each
activation row to int8 per block and runs the block dot products on integers, as llama.cpp does
on CPUs. A row's result never depends on the other rows of the call (the kernel's design;
tests/models/test_lowbit.py), so these layers are batch-invariant as they stand.

From a GGUF, Q8_0 (on q8) and Q5_0 (on q5) weights come back exactly: the requantization
finds their (float16) scales again. Q4_K and Q6_K blocks become q4k and q6 records as they are
(loading/q4k.py, loading/q6k.py). Other types are re-quantized from their float32 values.

The kernels run on AVX-512 VNNI where the CPU has it and on AVX2 otherwise (`kernel_isa`;
SPECSERVE_CPU_ISA=avx2 forces AVX2); both give the same bits. Linears that read the same
input run as one call: lowbit_fused.py.
"""

from __future__ import annotations

from types import ModuleType
from typing import cast

import torch
from torch import nn

from specserve.ops.cpu.build import load

GROUP = 32
TILE = 8  # outputs per record: one float32 lane each in ops/cpu/lowbit.cpp
STEP = 4  # inputs per integer step: a step holds 4 inputs of each of the tile's 8 outputs
FIELD = TILE * 2  # bytes of a record's float16 field (8 scales, or 8 lows)
Q8_SHIFT = 0x80  # q8 records hold q + 128 (q xor 0x80 as bytes): VNNI's unsigned operand


def kernel_isa(want: str = "") -> str:
    """The instruction set the low-bit kernels run on ("avx2" or "avx512vnni"); `want` sets
    it ("auto": the best this CPU has). A RuntimeError says when the CPU lacks it."""
    return cast(str, load().lowbit_isa(want))


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


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] in 0..15 -> [N, K/2] uint8: a block's byte i holds element i (low nibble)
    and element i + 16 (high nibble), GGUF's order."""
    n, k = q.shape
    g = q.to(torch.uint8).view(n, k // GROUP, GROUP)
    return (g[..., : GROUP // 2] | (g[..., GROUP // 2 :] << 4)).reshape(n, k // 2).contiguous()


def q4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] -> packed: [N, K/2] uint8 (pack_nibbles), scale and low: [N, K/32]
    (w ~ q * scale + low)."""
    q, scale, low = int4_groups(w)
    return pack_nibbles(q), scale.contiguous(), low.contiguous()


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


def q5_blocks(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w: [N, K] -> nibbles [N, K/2] uint8 (pack_nibbles of the low 4 bits), fifth bits
    [N, K/32, 32] uint8 (0 or 1), scale and low [N, K/32]: GGUF Q5_0's split of int5_groups."""
    q, scale, low = int5_groups(w)
    fifth = (q >> 4).to(torch.uint8).view(w.shape[0], -1, GROUP)
    return pack_nibbles(q & 15), fifth, scale, low


SUB = 16  # inputs per q6 sub-scale (GGUF Q6_K's sub-blocks)
SUPER = 256  # inputs per q4k record (GGUF Q4_K's super-blocks)


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


# The kernel's records (ops/cpu/lowbit.cpp): per tile of 8 outputs and block of 32 inputs,
# stored [tile][block][record], N padded with zero outputs. A record's fields, in order:
#   q8: scale[8] float16, weights + 128 [8 steps][8 outputs][4] uint8          272 bytes
#   q4: scale[8], low[8] float16, then steps 2i and 2i+1 in the low and high nibbles of
#       one [8 outputs][4] byte array each                                   160 bytes
#   q5: scale[8] float16, q4's nibble arrays, then the fifth bits: bit j of byte i is
#       step j's byte i (low = -16 scale is implied: the kernel subtracts 16)  176 bytes
#   q6: d[8] float16, sc[2][8] int8 (steps 0-3, then 4-7), q4's nibble arrays for the low
#       4 bits, then bit_planes of the top 2 bits                            224 bytes
#   q4k: per tile and 256 inputs (8 blocks): d[8], dmin[8] float16, sc[8 blocks][8] and
#       m[8 blocks][8] uint8, then each block's q4 nibble arrays              1184 bytes
#   q6k: per tile and 256 inputs: d[8] float16, then each block's q6 record less its d
#                                                                            1680 bytes


def tiled(t: torch.Tensor) -> torch.Tensor:
    """[N, K/32, ...] per-block values -> [ceil(N/8), K/32, 8, ...], padded with zeros."""
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, TILE, *t.shape[1:]).transpose(1, 2)


def untiled(t: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of tiled: [T, K/32, 8, ...] -> [N, K/32, ...]."""
    t = t.transpose(1, 2)
    return t.reshape(-1, *t.shape[2:])[:n]


def steps(q: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [T, K/32, 8 steps, 32]: step j holds inputs 4j..4j+3 of each of a tile's
    8 outputs, output-major (the bytes one 256-bit load gives the kernel)."""
    n, k = q.shape
    t = tiled(q.reshape(n, k // GROUP, GROUP // STEP, STEP))  # [T, nb, out, step, 4]
    return t.transpose(2, 3).reshape(*t.shape[:2], GROUP // STEP, TILE * STEP)


def unsteps(s: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of steps: [T, K/32, 8, 32] -> [N, K]."""
    t, nb = s.shape[:2]
    per_out = s.view(t, nb, GROUP // STEP, TILE, STEP).transpose(2, 3)  # [T, nb, out, step, 4]
    return untiled(per_out, n).reshape(n, nb * GROUP)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[T, K/32, ...] of any dtype -> [T, K/32, bytes] uint8 (a record field)."""
    return t.contiguous().view(torch.uint8).reshape(*t.shape[:2], -1)


def scale_fields(*per_block: torch.Tensor) -> list[torch.Tensor]:
    """[N, K/32] values that float16 holds exactly (scale, low) -> their record fields."""
    return [as_bytes(tiled(v.half())) for v in per_block]


def field_values(records: torch.Tensor, at: int, n: int) -> torch.Tensor:
    """The [N, K/32] values (as float32) of the float16 field at byte `at` of each record."""
    field = records[..., at : at + FIELD].contiguous().view(torch.float16)
    return untiled(field, n).float().contiguous()


def nibble_steps(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] in 0..15 -> [T, K/32, 128] uint8: steps 2i, 2i+1 share a 32-byte array."""
    s = steps(q.to(torch.uint8))
    return as_bytes(s[:, :, 0::2] | (s[:, :, 1::2] << 4))


def nibbles_from_steps(field: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of nibble_steps: [N, K] int64 in 0..15."""
    t, nb = field.shape[:2]
    pairs = field.reshape(t, nb, GROUP // STEP // 2, TILE * STEP).long()
    s = torch.stack([pairs & 15, pairs >> 4], dim=3).view(t, nb, GROUP // STEP, -1)
    return unsteps(s, n)


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


def bits_from_planes(planes: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The inverse of bit_planes: [N, K] int64 of `bits` bits."""
    t, nb = planes.shape[:2]
    per = GROUP // STEP // bits
    shift = (bits * torch.arange(per))[:, None]
    by_plane = planes.reshape(t, nb, bits, 1, GROUP).long() >> shift  # [T, nb, bits, per, 32]
    return unsteps((by_plane & (2**bits - 1)).view(t, nb, GROUP // STEP, -1), n)


class LowbitCall(nn.Module):
    """Shape handling and the kernel call over one or more weight matrices (`parts`)."""

    kernels: ModuleType
    bias: nn.Parameter | None
    in_features: int
    out_features: int

    def parts(self) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """(records, kinds, output counts) of the matrices side by side in the output."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:  # the models' case: no reshapes, no casts
            return self.matmul(x)
        rows = x.reshape(-1, self.in_features)
        y = self.matmul(rows.float())
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def matmul(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """rows [M, K] float32 -> [M, N]; into `out` (contiguous [M, N] float32) if given."""
        records, kinds, n_outs = self.parts()
        return self.kernels.lowbit_linear(rows, records, kinds, n_outs, self.bias, out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class LowbitLinear(LowbitCall):
    """One weight matrix; subclasses quantize the weights into records."""

    KIND = -1  # the kernel's number for this kind (ops/cpu/lowbit.cpp RECORD_BYTES)
    # inputs under one scale of x: a block of 32, or a super-block of 256 for the GGUF
    # k-quant kinds (the kernel sums their block dots over it as integers)
    X_GROUP = GROUP
    records: torch.Tensor  # the kernel's tiled blocks (a buffer)

    def __init__(
        self, records: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.kernels = load()
        self.register_buffer("records", records)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), False)

    def parts(self) -> tuple[list[torch.Tensor], list[int], list[int]]:
        return [self.records], [self.KIND], [self.out_features]

    @classmethod
    def from_records(
        cls, records: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None
    ) -> LowbitLinear:
        """A layer of this kind over records made elsewhere (no quantization)."""
        layer = cls.__new__(cls)
        LowbitLinear.__init__(layer, records, out_features, in_features, bias)
        return layer

    @staticmethod
    def check_in_features(weight: torch.Tensor) -> None:
        """A clear error when in_features is not a whole number of blocks of 32."""
        if weight.shape[1] % GROUP:
            raise ValueError(f"low-bit kernels need in_features divisible by {GROUP}")


def writes_into(layer: nn.Module) -> bool:
    """Whether linear_into writes this layer's output into a caller's buffer."""
    return isinstance(layer, LowbitCall)


def linear_into(layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """layer(x), written into `out` ([M, N] float32) where the layer is a low-bit kernel;
    any other layer (float32, CUDA) returns a new tensor as usual."""
    floats = x.dtype == torch.float32 and x.dim() == 2
    if out is not None and writes_into(layer) and floats:
        return cast(LowbitCall, layer).matmul(x, out)
    return cast(torch.Tensor, layer(x))


class Q8Linear(LowbitLinear):
    KIND = 0

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.check_in_features(weight)
        q, scale = q8_blocks(weight)
        # q + 128 as unsigned bytes: the VNNI kernels' unsigned operand (the AVX2 ones undo it)
        shifted = as_bytes(steps(q)) ^ Q8_SHIFT
        records = torch.cat([*scale_fields(scale), shifted], dim=-1)
        super().__init__(records, weight.shape[0], weight.shape[1], bias)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K] int8, scale [N, K/32]) back from the records, as q8_blocks gave them."""
        n, t, nb = self.out_features, *self.records.shape[:2]
        shifted = self.records[..., FIELD:].reshape(t, nb, GROUP // STEP, -1)
        q = unsteps(shifted ^ Q8_SHIFT, n)
        return q.view(torch.int8).contiguous(), field_values(self.records, 0, n)


class Q4Linear(LowbitLinear):
    KIND = 1

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.check_in_features(weight)
        q, scale, low = int4_groups(weight)
        super().__init__(self.records_of(q, scale, low), weight.shape[0], weight.shape[1], bias)

    @staticmethod
    def records_of(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        """q [N, K] in 0..15, scale and low [N, K/32] holding float16 values -> records."""
        return torch.cat([*scale_fields(scale, low), nibble_steps(q)], dim=-1)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed [N, K/2] uint8, scale, low [N, K/32]) back from the records."""
        n, r = self.out_features, self.records
        q = nibbles_from_steps(r[..., 2 * FIELD :], n)
        return pack_nibbles(q), field_values(r, 0, n), field_values(r, FIELD, n)


class Q5Linear(LowbitLinear):
    KIND = 2

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.check_in_features(weight)
        q, scale, _ = int5_groups(weight)  # low = -16 scale: the kernel's offset
        fields = [*scale_fields(scale), nibble_steps(q & 15), bit_planes(q >> 4, 1)]
        super().__init__(torch.cat(fields, dim=-1), weight.shape[0], weight.shape[1], bias)

    def blocks(self) -> tuple[torch.Tensor, ...]:
        """(nibbles [N, K/2], fifth bits [N, K/32, 32], scale, low) back from the records."""
        n, r = self.out_features, self.records
        nibbles = nibbles_from_steps(r[..., FIELD:-GROUP], n)
        fifth = bits_from_planes(r[..., -GROUP:], n, 1).to(torch.uint8)
        scale = field_values(r, 0, n)
        return pack_nibbles(nibbles), fifth.view(n, -1, GROUP), scale, -16 * scale


class Q6Linear(LowbitLinear):
    """GGUF Q6_K's own values: w = d * sc * (q - 32), q 0..63, an int8 sc per 16 inputs.
    0.875 bytes per weight (Q6_K: 0.82; these tensors ran on q8's 1.0625 before)."""

    KIND = 3

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.check_in_features(weight)
        q, d, sc = int6_groups(weight)
        super().__init__(self.records_of(q, d, sc), weight.shape[0], weight.shape[1], bias)

    @staticmethod
    def records_of(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
        """q [N, K] in 0..63, d [N, K/32] holding float16 values, sc [N, K/16] int8 -> records."""
        n, k = q.shape
        sub = as_bytes(tiled(sc.to(torch.int8).view(n, k // GROUP, 2)).transpose(2, 3))
        fields = [*scale_fields(d), sub, nibble_steps(q & 15), bit_planes(q >> 4, 2)]
        return torch.cat(fields, dim=-1)

    @classmethod
    def from_groups(
        cls, q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, bias: torch.Tensor | None
    ) -> Q6Linear:
        """A layer of these values as given (GGUF Q6_K's: loading/q6k.py); d must be float16
        values (Q6_K's are), so nothing is rounded."""
        records = cls.records_of(q, half_values(d), sc)
        return cast(Q6Linear, cls.from_records(records, q.shape[0], q.shape[1], bias))

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K] int32, d [N, K/32], sc [N, K/16] int8) back from the records."""
        return q6_blocks(self.records, self.out_features)


def q6_blocks(r: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] int32, d [N, K/32], sc [N, K/16] int8) of q6 records r."""
    t, nb = r.shape[:2]
    sub = r[..., FIELD : 2 * FIELD].contiguous().view(torch.int8).view(t, nb, 2, TILE)
    sc = untiled(sub.transpose(2, 3), n).reshape(n, -1)
    low = nibbles_from_steps(r[..., 2 * FIELD : -2 * GROUP], n)
    q = low + 16 * bits_from_planes(r[..., -2 * GROUP :], n, 2)
    return q.to(torch.int32), field_values(r, 0, n), sc.contiguous()


class Q6KLinear(LowbitLinear):
    """GGUF Q6_K's own layout: q6's values with d once per 256 inputs, as the file stores it.
    A record holds 8 outputs x 256 inputs: d[8] float16, then each block's q6 record less its
    d. 0.820 bytes per weight (q6, d per block of 32: 0.875). The kernel runs q6's steps on x
    scaled per 256 inputs and sums the 8 block dots as integers under one float step."""

    KIND = 5
    X_GROUP = SUPER
    BLOCKS = SUPER // GROUP  # blocks a record covers

    @classmethod
    def from_groups(
        cls, q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, bias: torch.Tensor | None
    ) -> Q6KLinear:
        """A layer of GGUF Q6_K's values (loading/q6k.py q6k_groups): d [N, K/32] must be one
        float16 value per 256 inputs, repeated (as q6k_groups gives it)."""
        n, k = q.shape
        per_super = d.view(n, k // SUPER, cls.BLOCKS)
        if not torch.equal(per_super, per_super[..., :1].expand_as(per_super)):
            raise ValueError("q6k: d must be one value per 256 inputs")
        r = Q6Linear.records_of(q, half_values(d), sc)
        t, nb = r.shape[:2]
        r = r.view(t, nb // cls.BLOCKS, cls.BLOCKS, -1)
        records = torch.cat([r[:, :, 0, :FIELD], r[..., FIELD:].flatten(2)], dim=-1)
        return cast(Q6KLinear, cls.from_records(records, n, k, bias))

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K] int32, d [N, K/32], sc [N, K/16] int8) back from the records."""
        r = self.records
        t, supers = r.shape[:2]
        d = r[..., None, :FIELD].expand(t, supers, self.BLOCKS, FIELD)
        rest = r[..., FIELD:].view(t, supers, self.BLOCKS, -1)
        q6 = torch.cat([d, rest], dim=-1).view(t, supers * self.BLOCKS, -1)
        return q6_blocks(q6, self.out_features)


class Q4KLinear(LowbitLinear):
    """GGUF Q4_K's own values: w = d * sc * q - dmin * m, q 0..15, 6-bit sc and m per block of
    32, d and dmin per 256 inputs. One record holds 8 outputs x 256 inputs, so d and dmin are
    stored once per 8 blocks: 0.578 bytes per weight (Q4_K: 0.5625; q4, with a float16 scale
    and low per block: 0.625), and the weights are the file's, where q4 rounds d * sc and
    dmin * m to float16."""

    KIND = 4
    X_GROUP = SUPER

    @staticmethod
    def records_of(
        q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
    ) -> torch.Tensor:
        """q [N, K] in 0..15; sc, m [N, K/32] in 0..63; d, dmin [N, K/256] holding float16
        values -> records [ceil(N/8), K/256, 1184]."""
        n, k = q.shape
        supers = k // SUPER

        def per_super(t: torch.Tensor) -> torch.Tensor:  # [T, K/32, ...] -> [T, K/256, bytes]
            return t.reshape(t.shape[0], supers, -1)

        halves = [as_bytes(tiled(v.half())) for v in (d, dmin)]
        ints = [per_super(as_bytes(tiled(v.to(torch.uint8)))) for v in (sc, m)]
        return torch.cat([*halves, *ints, per_super(nibble_steps(q))], dim=-1)

    @classmethod
    def from_fields(
        cls,
        q: torch.Tensor,
        sc: torch.Tensor,
        m: torch.Tensor,
        d: torch.Tensor,
        dmin: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> Q4KLinear:
        """A layer of these values as given (loading/q4k.py q4k_fields)."""
        records = cls.records_of(q, sc, m, half_values(d), half_values(dmin))
        return cast(Q4KLinear, cls.from_records(records, q.shape[0], q.shape[1], bias))

    def fields(self) -> tuple[torch.Tensor, ...]:
        """(q [N, K], sc, m [N, K/32], d, dmin [N, K/256]) back from the records."""
        n, r = self.out_features, self.records
        t, supers = r.shape[:2]
        d, dmin = field_values(r, 0, n), field_values(r, FIELD, n)
        blocks = 2 * FIELD + 8 * TILE

        def ints(at: int) -> torch.Tensor:
            per_block = r[..., at : at + 8 * TILE].reshape(t, supers * 8, TILE)
            return untiled(per_block, n).long()

        weights = r[..., blocks + 8 * TILE :].reshape(t, supers * 8, -1)
        q = nibbles_from_steps(weights, n)
        return q, ints(2 * FIELD), ints(2 * FIELD + 8 * TILE), d, dmin
