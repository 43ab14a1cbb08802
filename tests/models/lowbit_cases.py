"""Cases for the low-bit kernel tests: random weights of every kind, and the naive twin's
view of a layer (ops/naive/lowbit.py)."""

from __future__ import annotations

import torch

from specserve.models.layers.lowbit import (
    LowbitLinear,
    Q4KLinear,
    Q4Linear,
    Q5Linear,
    Q6KLinear,
    Q6Linear,
    Q8Linear,
)
from specserve.ops.naive.lowbit import GROUP, READERS, lowbit_linear


def case(n: int = 70, k: int = 160, m: int = 9) -> tuple[torch.Tensor, ...]:
    """Seeded weight [n, k], bias [n] and x [m, k]."""
    g = torch.Generator().manual_seed(n * k + m)
    return (
        torch.randn(n, k, generator=g),
        torch.randn(n, generator=g),
        torch.randn(m, k, generator=g),
    )


def record_values(layer: LowbitLinear) -> tuple[torch.Tensor, ...]:
    """The values the layer's records hold, read back by the naive twin."""
    return READERS[layer.KIND](layer.records, layer.out_features)


def reference(x: torch.Tensor, layer: LowbitLinear) -> torch.Tensor:
    """The layer's output from the naive twin in float64: exact integer block dots, float
    steps that do not round (the bias added)."""
    parts = [layer.records], [layer.KIND], [layer.out_features]
    return lowbit_linear(x, *parts, layer.bias, dtype=torch.float64)


def twin(x: torch.Tensor, layer: LowbitLinear) -> torch.Tensor:
    """The layer's output from the naive twin in float32: the kernel's own bits."""
    parts = [layer.records], [layer.KIND], [layer.out_features]
    return lowbit_linear(x, *parts, layer.bias)


def q4k_layer(n: int = 70, k: int = 512, seed: int = 0, bias: bool = True) -> Q4KLinear:
    """Random GGUF Q4_K fields (every q level, 6-bit sc and m) as a q4k layer."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    sc, m = (torch.randint(0, 64, (n, k // GROUP), generator=g) for _ in range(2))
    d, dmin = ((torch.rand(n, k // 256, generator=g) * 1e-3).half().float() for _ in range(2))
    b = torch.randn(n, generator=g) if bias else None
    return Q4KLinear.from_fields(q, sc, m, d, dmin, b)


def q6k_groups(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random GGUF Q6_K values: q 0..63, int8 sc per 16 (either sign), d one float16 value
    per 256 inputs, repeated per block of 32 (as loading/q6k.py gives them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 64, (n, k), generator=g, dtype=torch.int32)
    sc = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
    d = (torch.rand(n, k // 256, 1, generator=g) * 1e-3).half().float()
    return q, d.expand(-1, -1, 256 // GROUP).reshape(n, k // GROUP), sc


KINDS = [Q8Linear, Q4Linear, Q5Linear, Q6Linear, Q4KLinear, Q6KLinear]


def any_kind(cls: type) -> tuple[LowbitLinear, torch.Tensor]:
    """A layer of kind `cls` over 70 outputs (a padded last tile) x 1024 inputs, and x [37, K]."""
    w, bias, x = case(n=70, k=1024, m=37)
    if cls is Q4KLinear:
        return q4k_layer(n=70, k=1024), x
    if cls is Q6KLinear:
        return Q6KLinear.from_groups(*q6k_groups(70, 1024, seed=12), bias), x
    return cls(w, bias), x
