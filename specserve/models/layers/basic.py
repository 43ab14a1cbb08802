"""Norm, rotary embedding and gated MLP: the small pieces of every dense transformer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.layers.lowbit_fused import joint_output
from specserve.ops.cpu.build import kernels_for


class RMSNorm(nn.Module):
    """y = x / rms(x) * w over the last dim.

    Gemma's (1 + w) form is folded into `w` by the loaders, so one norm serves all families.
    Half-precision inputs are normalised in float32 (as llama.cpp and transformers do);
    float32/float64 inputs stay in their own dtype so float64 runs are exact.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = kernels_for(x, self.weight) if self.weight.dtype == torch.float32 else None
        if kernels is not None and x.shape[-1] % 8 == 0:
            return kernels.rms_norm(x, self.weight, self.eps)  # ops/cpu/pointwise.cpp
        h = x.float() if x.element_size() < 4 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.to(h.dtype)).to(x.dtype)


def add_norm(x: torch.Tensor, y: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, ...]:
    """(x + y, norm(x + y)): a residual add and the norm after it, one op on float32 CPU
    (ops/cpu/pointwise.cpp add_rms_norm, bit-equal to the two apart)."""
    kernels = kernels_for(x, y, norm.weight) if norm.weight.dtype == torch.float32 else None
    if kernels is not None and x.shape[-1] % 8 == 0 and y.dtype == x.dtype:
        return tuple(kernels.add_rms_norm(x, y, norm.weight, norm.eps))
    s = x + y
    return s, norm(s)


class RotaryEmbedding(nn.Module):
    """NeoX-style rotary embedding (rotate halves), angles computed in float32.

    float32 angles match transformers and llama.cpp; the rotation itself runs in the
    activation dtype. `scale` divides positions (linear rope scaling). The frequencies are
    made on first use, on the positions' device, so the module can be built on `meta`.
    """

    def __init__(self, head_dim: int, theta: float, scale: float = 1.0) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scale = head_dim, theta, scale
        self._inv_freq: torch.Tensor | None = None
        # layers sharing this module in one forward reuse the tables of the same positions
        self._memo: tuple[torch.Tensor, torch.dtype, tuple[torch.Tensor, ...]] | None = None
        # cos and sin of every position below a power of two, per dtype and device: a
        # draft head's one-row steps paid more for their few angles than for the lookup
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            self._inv_freq = (1.0 / (self.theta**exponent) / self.scale).to(device)
        return self._inv_freq

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, end: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """positions: [T] -> cos, sin: [T, 1, head_dim] (broadcast over heads). end: above
        every position, if the caller knows it (else it is read from `positions`)."""
        memo = self._memo
        if memo is not None and memo[0] is positions and memo[1] == dtype:
            return memo[2]
        if end is None:
            end = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = self._table(end, dtype, positions.device)
        tables = cos.index_select(0, positions), sin.index_select(0, positions)
        self.__dict__["_memo"] = (positions, dtype, tables)  # past nn.Module's __setattr__
        return tables

    def _table(
        self, end: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """cos, sin [n, 1, head_dim] in `dtype` for positions 0 .. n - 1, n >= end."""
        table = self._tables.get((dtype, device))
        if table is None or table[0].shape[0] < end:
            n = max(64, 1 << (end - 1).bit_length())
            positions = torch.arange(n, device=device)
            freqs = positions.float()[:, None] * self.inv_freq(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            table = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
            self._tables[(dtype, device)] = table
        return table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D]."""
    kernels = kernels_for(x) if cos.dtype == torch.float32 else None
    if kernels is not None:
        return kernels.rotary(x, cos, sin)  # ops/cpu/pointwise.cpp
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (llama, qwen) or GeGLU with tanh-gelu (gemma)."""

    def __init__(self, hidden: int, inner: int, activation: str) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        self.activation, self.inner = activation, inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up fused into one low-bit call: act * mul in one op on its whole output
        gate_up = joint_output((self.gate, self.up), x) if self.inner % 8 == 0 else None
        if gate_up is not None and (kernels := kernels_for(gate_up)) is not None:
            return self.down(kernels.gated(gate_up, self.activation == "silu"))
        g = self.gate(x)
        g = F.silu(g) if self.activation == "silu" else F.gelu(g, approximate="tanh")
        return self.down(g * self.up(x))
