"""Weight-only quantized linear layers, swapped in by module.

Two families of kernels:
- ours (layers/lowbit.py, AVX2, float32 activations): int8, int6, int5 and int4 in blocks of
  32 inputs. Used whenever the compute dtype is float32 on CPU and the kernels build (the default).
- torch's, for bf16 compute or where ours cannot build: int8 with one scale per output
  channel (`aten._weight_int8pack_mm`), int4 with one scale and zero per group of 32
  (`aten._weight_int4pack_mm_for_cpu`). Both take bf16 activations (they are several times
  slower with float32), so inputs are cast to bf16 and outputs back to the caller's dtype.
Linears swap in by module, as in gpt-fast's quantize.py: `swap_linears` on a built float
model, or, when loading (loading/convert.py), `quantize_weight` on each weight as it arrives.

GGUF weights arrive dequantized to float32 and are re-quantized here: exact for Q8_0 on int8
and Q5_0 on int5 (tests/models/test_lowbit.py), approximate for the others. (Q4_K and Q6_K
blocks skip this on our kernels: loading/convert.py.)
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.models.layers.lowbit import Q4Linear, Q5Linear, Q6Linear, Q8Linear
from specserve.ops.naive.lowbit import int4_groups

GROUP = 32
WEIGHT_MODES = ("auto", "dequant", "int8", "int6", "int5", "int4")
# a draft model's or head's kernels under --draft-weights auto: a draft's precision moves
# only how many of its tokens are kept, never the output, and int4 kept about as many as
# int8 at about half the bytes a draft token reads (docs/perf/2026-11-28-draft-int4.md)
DRAFT_AUTO = "int4"


def quantized_kernels_run(compute: torch.dtype, device: torch.device | str) -> bool:
    """Whether quantized linears run for this compute dtype and device: not for float64,
    not off the CPU (where --weights auto keeps float weights)."""
    return compute != torch.float64 and torch.device(device).type == "cpu"


def draft_mode(weights: str, compute: torch.dtype, device: torch.device | str) -> str:
    """The --weights a draft is loaded with under --draft-weights `weights`: auto stays auto
    (float weights) where no quantized kernel runs."""
    if weights != "auto" or not quantized_kernels_run(compute, device):
        return weights
    return DRAFT_AUTO


# GGUF tensor type -> the kernel `--weights auto` picks: 4-bit formats run on int4, Q5_0 on
# int5 (the same symmetric blocks: exact), Q6_K on int6 (its own values: exact), the other
# 5- to 8-bit ones on int8 (fewer bits would drop some of every weight), float ones stay float.
_AUTO = {
    **dict.fromkeys(("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS"), "int4"),
    "Q5_0": "int5",
    "Q6_K": "int6",
    **dict.fromkeys(("Q5_1", "Q5_K", "Q8_0", "Q8_1", "Q8_K"), "int8"),
}


def auto_mode(gguf_type: str) -> str | None:
    """The kernel for a GGUF tensor type under --weights auto (None = keep it float)."""
    return _AUTO.get(gguf_type)


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T + bias; q: [N, K] int8, scale: [N] bf16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
        self.register_buffer("q", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.q, self.scale
        )
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1).to(x.dtype)


class Int4Linear(nn.Module):
    """Groups of 32 inputs: w = q * scale + min, q in 0..15, packed in torch's CPU layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {k}")
        q, scale, low = int4_groups(weight.float())
        # torch's format reads w = (q - 8) * scale + zero, so zero = low + 8 * scale
        zero = low + 8 * scale
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("packed", packed)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
        self.register_buffer("scale_zero", sz.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), False)
        self.out_features, self.in_features = n, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed, GROUP, self.scale_zero
        )
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1).to(x.dtype)


# torch has no 5- or 6-bit kernel: under bf16, int5 and int6 run on its int8 one
_TORCH_KERNELS: dict[str, type[nn.Module]] = {
    "int8": Int8Linear,
    "int6": Int8Linear,
    "int5": Int8Linear,
    "int4": Int4Linear,
}
_LOWBIT_KERNELS: dict[str, type[nn.Module]] = {
    "int8": Q8Linear,
    "int6": Q6Linear,
    "int5": Q5Linear,
    "int4": Q4Linear,
}


def quantize_weight(
    weight: torch.Tensor, bias: torch.Tensor | None, mode: str, lowbit: bool = False
) -> nn.Module:
    """The quantized linear for these float weights. lowbit: our float32-activation kernels
    instead of torch's bf16 ones."""
    return (_LOWBIT_KERNELS if lowbit else _TORCH_KERNELS)[mode](weight, bias)


def quantize_linear(linear: nn.Linear, mode: str, lowbit: bool = False) -> nn.Module:
    bias = None if linear.bias is None else linear.bias.detach()
    return quantize_weight(linear.weight.detach(), bias, mode, lowbit)


def swap_linears(model: nn.Module, modes: dict[str, str], lowbit: bool = False) -> None:
    """Replace each named nn.Linear ("layers.0.attn.q") with its quantized twin."""
    for name, mode in modes.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name} is not an nn.Linear")
        setattr(parent, child, quantize_linear(linear, mode, lowbit))
