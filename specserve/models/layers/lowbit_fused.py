"""Low-bit linears that read the same input (q/k/v, gate/up) fused into one kernel call.

`fuse_lowbit` swaps each such group of a model for a `FusedLowbit` and leaves `FusedPart`s
where the separate linears stood, so the model code is the same in every weight mode;
`joint_output` and `fused_of` let a caller ask for the parts' outputs side by side.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from specserve.models.layers.lowbit import LowbitCall, LowbitLinear
from specserve.ops.cpu.build import load
from specserve.ops.naive.lowbit import TILE


class FusedLowbit(LowbitCall):
    """Low-bit linears that read the same input (q/k/v, gate/up) run as one kernel call.

    Each call has a fixed cost (quantizing x, starting threads), a large share of a small
    matrix's time (figures: docs/perf/lowbit.md), so one call for three saves two. The parts
    may be of different kinds (GGUF files mix them: the 0.5B's q and k are Q5_0, its v Q8_0;
    the 1.5B's q4k and q6k): the kernel walks each part's records with its own arithmetic.
    They share x's quantization, so they are all of one X_GROUP (fuse_lowbit fuses only
    such). The parts stay in the model as `FusedPart`s, so the model code is the same in
    every weight mode: the first part called with an input computes all outputs, the parts
    after it in the same pass slice them. The outputs are bit-identical to the separate
    layers' (an output's arithmetic depends only on its own records and x). Every part but
    the last must fill whole tiles.
    """

    def __init__(self, parts: list[LowbitLinear]) -> None:
        super().__init__()
        self.kernels = load()
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        for i, p in enumerate(parts):  # the parts' own tensors: nothing is copied
            self.register_buffer(f"records_{i}", p.records)
        self.kinds, self.n_outs = [p.KIND for p in parts], [p.out_features for p in parts]
        biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        has_bias = any(p.bias is not None for p in parts)
        self.bias = nn.Parameter(torch.cat(biases), False) if has_bias else None
        self.bounds = [0]
        for p in parts:
            self.bounds.append(self.bounds[-1] + p.out_features)
        # (input, all outputs, the part that may use them next)
        self._last: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def parts(self) -> tuple[list[torch.Tensor], list[int], list[int]]:
        records = [getattr(self, f"records_{i}") for i in range(len(self.kinds))]
        return records, self.kinds, self.n_outs

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:
        last = self._last
        # reuse only for the next parts of one pass (q, k, v in order) over the same input
        # object (kept alive by the memo); any other call computes afresh
        if last is None or last[0] is not x or i < last[2]:
            last = (x, self(x), i)
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


def fused_of(parts: tuple[nn.Module, ...]) -> FusedLowbit | None:
    """The FusedLowbit whose parts are, in order, exactly `parts`; None otherwise."""
    first = parts[0]
    if not isinstance(first, FusedPart):
        return None
    fused = first.fused[0]
    if len(fused.bounds) - 1 != len(parts) or any(
        not isinstance(p, FusedPart) or p.fused[0] is not fused or p.i != i
        for i, p in enumerate(parts)
    ):
        return None
    return fused


def joint_output(parts: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor | None:
    """The outputs of `parts` side by side from one kernel call, when they are in order all
    the parts of one FusedLowbit (gate, up -> [..., gate | up]); None otherwise."""
    fused = fused_of(parts)
    return None if fused is None else cast(torch.Tensor, fused(x))


# children that read the same input, in the order the models call them
FUSE_GROUPS = (("q", "k", "v"), ("gate", "up"))


def fuse_lowbit(model: nn.Module) -> int:
    """Fuse each group of low-bit linears in `model`, in place; returns the count."""
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
    # one call quantizes x once, so its parts must want x scaled over the same group
    return all(
        isinstance(p, LowbitLinear)
        and p.in_features == first.in_features
        and p.X_GROUP == first.X_GROUP
        and p.out_features % TILE == 0
        for p in parts
    )
