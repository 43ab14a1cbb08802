"""float32 linears on oneDNN's pre-packed weights: cheap verification rows on CPU.

torch's F.linear hands float32 to MKL's sgemm, which re-packs the whole weight matrix on
every call. For one row it takes a matrix-vector path; from two rows on, each call reads
the weights, writes a packed copy and reads that again, so on this project's AVX2 CPU a
forward over a few tokens costs several times one token's, while the weights (the real cost
of a decode step) are the same. Verifying a draft is exactly such a forward.

oneDNN can pack a weight once, at load (`torch.ops.mkldnn._reorder_linear_weight`, what
inductor's CPU weight pre-packing uses), and then run any row count on the packed copy,
where extra rows cost little (figures: docs/perf/kernels.md). The packed layout also makes
a row's result independent of the other rows in the call (bit for bit, M = 1..64:
tests/models/test_packed.py), which is the batch invariance that plain MKL float32 lacks
(layers/invariant.py).

The packed copy replaces the weight (a tied LM head gets its own copy; the embedding
table stays, or, for a GGUF's block-quantized table, the loader keeps the embedding in its
blocks and the float table goes with the unpacked head). Only float32 on CPU, where oneDNN
is built in.
"""

from __future__ import annotations

import torch
from torch import nn

# the row count oneDNN packs for; from 4 on it picks the blocked layout that every row
# count then runs on (with 1 it picks a layout whose rows differ between 1 and 2+ rows)
PACK_ROWS = 16


def can_pack(linear: nn.Linear) -> bool:
    w = linear.weight
    on_cpu = w.device.type == "cpu" and torch.backends.mkldnn.is_available()
    return on_cpu and w.dtype == torch.float32


class PackedLinear(nn.Module):
    """An nn.Linear whose weight lives in oneDNN's packed layout (`weight` is that copy:
    its dtype and device are the linear's; it is not a dense matrix)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
        self.register_buffer("weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module) -> int:
    """Swap every float32 CPU nn.Linear of `model` for a PackedLinear, in place; returns
    how many were swapped."""
    n = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            # exactly nn.Linear: not its quantized or row-padded stand-ins
            if type(child) is nn.Linear and can_pack(child):
                setattr(module, name, PackedLinear(child))
                n += 1
    return n
