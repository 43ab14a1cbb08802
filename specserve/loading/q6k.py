"""GGUF Q6_K blocks read as the low-bit kernels' q6 fields, with no requantization.

Q6_K holds 256 weights per super-block: the low 4 bits of each 6-bit value q (128 bytes),
their top 2 bits (64 bytes), an int8 scale sc per 16 weights (16 bytes) and a float16 d:
w = d * sc * (q - 32). Our q6k record keeps q, sc and d as they are (d once per 256 inputs,
models/layers/lowbit.py Q6KLinear), so the weights are the file's own, bit for bit. On q8,
where these tensors ran before, they took 1.0625 bytes per weight and a requantization; q6
(d repeated per block of 32) 0.875; q6k takes 0.820, Q6_K's own figure.

The layout follows ggml's block_q6_K (ggml-common.h) and its dequantize_row_q6_K.
"""

from __future__ import annotations

import torch

SUPER = 256  # weights per super-block
BYTES = 210  # ql (128), qh (64), scales (16), d (2)


def q6k_groups(data: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K rows (uint8 [rows, bytes]) -> q [rows, cols] int32 in 0..63, d [rows, cols / 32]
    float32 (float16 values) and sc [rows, cols / 16] int8, with w = d * sc * (q - 32) as the
    gguf package dequantizes it ((d * sc) in float32, then times q - 32)."""
    rows = data.shape[0]
    if cols % SUPER or data.shape[1] != cols // SUPER * BYTES:
        raise ValueError(f"not Q6_K rows of {cols} weights: {tuple(data.shape)}")
    b = data.reshape(rows, cols // SUPER, BYTES)
    ql = b[..., :128].reshape(rows, -1, 2, 1, 64).to(torch.int32)  # two halves of 128 values
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32).to(torch.int32)
    # a half's 4 runs of 32: ql[0:32] and ql[32:64] low nibbles, then their high nibbles;
    # run g's top 2 bits are bits 2g, 2g+1 of qh
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(rows, -1, 2, 4, 32)
    top = (qh >> (2 * torch.arange(4, dtype=torch.int32))[:, None]) & 3
    q = (low | (top << 4)).reshape(rows, cols)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(rows, cols // 16)
    d = b[..., 208:210].contiguous().view(torch.float16).float()  # [rows, supers, 1]
    d = d.expand(-1, -1, SUPER // 32).reshape(rows, cols // 32)
    return q, d.contiguous(), sc.contiguous()
