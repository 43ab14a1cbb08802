"""Quantize linears while their weights stream in from the file.

Building the whole float32 model first and quantizing it after (gpt-fast's way) held every
weight in float32 at once: the 0.5B peaked at ~3.3 GB and the 1.5B at ~8.3 GB while loading,
for models that serve in ~0.6 and ~1.6 GB of quantized weights. Here each linear is
quantized as soon as its weight (and bias) arrive and the float copy is dropped, so the
float32 peak is one tensor, plus the embedding table, which stays float.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.errors import SpecserveError
from specserve.models.layers.quant import quantize_weight


class LinearConverter:
    """Takes the tensors of the linears in `modes` ("layers.0.attn.q" -> "int8") as they
    stream in and builds their quantized modules; `install` puts them into the model."""

    def __init__(self, model: nn.Module, modes: dict[str, str], lowbit: bool) -> None:
        self.modes, self.lowbit = modes, lowbit
        self.needs_bias = {name: model.get_submodule(name).bias is not None for name in modes}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.built: dict[str, nn.Module] = {}

    def owns(self, name: str) -> bool:
        """Whether a tensor name ("layers.0.attn.q.weight") belongs to a converted linear."""
        owner, _, leaf = name.rpartition(".")
        return owner in self.modes and leaf in ("weight", "bias")

    def take(self, name: str, tensor: torch.Tensor) -> None:
        owner, _, leaf = name.rpartition(".")
        parts = self.pending.setdefault(owner, {})
        parts[leaf] = tensor
        if "weight" in parts and ("bias" in parts or not self.needs_bias[owner]):
            del self.pending[owner]
            mode = self.modes[owner]
            self.built[owner] = quantize_weight(
                parts["weight"], parts.get("bias"), mode, self.lowbit
            )

    def install(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Swap the built modules in (a tied LM head is quantized from the embedding now)."""
        if "lm_head" in self.modes and "lm_head" not in self.built and "embed.weight" in state:
            self.take("lm_head.weight", state["embed.weight"])
        missing = sorted(set(self.modes) - set(self.built))
        if missing:
            raise SpecserveError(f"weights missing for the linears {missing[:5]}")
        for name, module in self.built.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module)
        self.built = {}
