"""GGUF Q4_K blocks read as the low-bit kernels' q4k fields, with no requantization.

Q4_K holds 256 weights per super-block: a float16 d and dmin, 8 sub-blocks of 32 weights
with a 6-bit scale sc and min m each (12 packed bytes), and the 4-bit values q (128 bytes):
w = d * sc * q - dmin * m. Our q4k records hold these fields as they are (q4k_fields), so the
weights are the file's. Dequantizing to float32 and quantizing again by min/max lost this:
nearly every block came back with other values (figures: docs/perf/lowbit.md).

The layout follows ggml's block_q4_K (ggml-common.h) and its get_scale_min_k4.
"""

from __future__ import annotations

import torch

SUPER = 256  # weights per super-block
BYTES = 144  # bytes per super-block: d, dmin (2 each), 12 scale bytes, 128 value bytes


def _scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """packed: [..., 12] uint8 -> sc, m: [..., 8] int32 (6 bits each).

    Sub-blocks 0-3 keep their scale and min in the low 6 bits of bytes j and j + 4;
    sub-blocks 4-7 take 4 low bits from byte j + 4's two nibbles and their top 2 bits from
    the spare top bits of bytes j - 4 and j (the first 8 bytes)."""
    p = packed.to(torch.int32)
    sc_lo, m_lo = p[..., 0:4] & 63, p[..., 4:8] & 63
    sc_hi = (p[..., 8:12] & 15) | ((p[..., 0:4] >> 6) << 4)
    m_hi = (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)
    return torch.cat([sc_lo, sc_hi], -1), torch.cat([m_lo, m_hi], -1)


def q4k_fields(
    data: torch.Tensor, cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows (uint8 [rows, bytes]) -> q [rows, cols] int32 in 0..15, sc and m
    [rows, cols / 32] int32 in 0..63, d and dmin [rows, cols / 256] float32 (float16 values):
    w = d * sc * q - dmin * m, the file's own fields."""
    rows = data.shape[0]
    if cols % SUPER or data.shape[1] != cols // SUPER * BYTES:
        raise ValueError(f"not Q4_K rows of {cols} weights: {tuple(data.shape)}")
    b = data.reshape(rows, cols // SUPER, BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float().reshape(rows, -1)
    dmin = b[..., 2:4].contiguous().view(torch.float16).float().reshape(rows, -1)
    sc, m = _scales_mins(b[..., 4:16])
    # 4 runs of 32 bytes; run i holds sub-block 2i in its low nibbles, 2i + 1 in its high
    qs = b[..., 16:].reshape(rows, cols // SUPER, 4, 1, 32).to(torch.int32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(rows, cols)
    return q, sc.reshape(rows, -1), m.reshape(rows, -1), d, dmin
