"""Batch-invariant mode: a row's result must not depend on the rows computed beside it.

Speculation verifies [last, d1..dk] in one forward, and other slots share the step; plain
decoding computes the same token as a one-row forward. On CPU two kernels break the
equality:
- float32 GEMM (MKL) picks its micro-kernels and blocking by the number of rows, so a
  1-row product differs from the same row inside a larger one (about 1e-7 relative);
  computing every product in separate blocks of 4 rows (the last one padded) gives every
  row the same call whatever its batch-mates (padding alone to a multiple of 4 held on
  AVX2 and Zen 4 but not on an Intel Xeon with AMX, whose MKL blocks larger products
  differently; tests/models/test_batch_invariant.py checks it on this machine's kernels);
- attention over a causal prefix reduces over a different number of keys when other rows
  share the call; computing each row alone against its own prefix (as decoding does)
  removes that.
The int8/int4 and bf16 kernels measured here are row-invariant already. This mode costs
speed (one attention call per row, padded GEMMs), so it is opt-in (`--deterministic`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.layers.attention import Attention

ROW_BLOCK = 4


class RowPaddedLinear(nn.Module):
    """An nn.Linear computed in separate products of ROW_BLOCK rows (the last padded)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        pad = (-rows.shape[0]) % ROW_BLOCK
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        y = torch.cat([F.linear(b, self.weight, self.bias) for b in rows.split(ROW_BLOCK)])
        return y[: y.shape[0] - pad].reshape(*x.shape[:-1], self.weight.shape[0])


def make_batch_invariant(model: nn.Module) -> None:
    """Switch a model into batch-invariant mode, in place."""
    for module in list(model.modules()):
        if isinstance(module, Attention):
            module.per_row = True
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, RowPaddedLinear(child))
