"""The residual stream at chosen layers' inputs, written once into one [T, n * D] tensor.

An EAGLE-3 head reads three of the target's layers (models/eagle3.py); the target's
forward writes each straight into its column block, so the runner logs one tensor and
nothing is concatenated afterwards.
"""

from __future__ import annotations

import torch


class Taps:
    def __init__(self, layers: tuple[int, ...], x: torch.Tensor) -> None:
        self.layers = layers
        d = x.shape[-1]
        self.out = x.new_empty(x.shape[0], len(layers) * d) if layers else None
        self._d = d

    def take(self, layer: int, x: torch.Tensor, h: torch.Tensor | None) -> None:
        """Layer `layer` is about to run on the stream x (+ h, the previous block's output
        whose residual add was left to the next norm)."""
        if self.out is None or layer not in self.layers:
            return
        for k, at in enumerate(self.layers):  # a layer may be tapped twice
            if at == layer:
                dst = self.out[:, k * self._d : (k + 1) * self._d]
                if h is None:
                    dst.copy_(x)
                else:
                    torch.add(x, h, out=dst)
