"""The residual stream at chosen layers' inputs, written once into one [T, n * D] tensor.

An EAGLE-3 head reads three of the target's layers (models/eagle3.py). Its caller hands the
target's forward a Taps, and the forward writes each tapped layer's input straight into its
column block, so the caller reads one tensor and nothing is concatenated afterwards. The
taps are the caller's, not the model's: engines built in turn over one loaded model (a
benchmark's) each tap what their own speculators read.
"""

from __future__ import annotations

import torch


class Taps:
    def __init__(self, layers: tuple[int, ...]) -> None:
        if not layers:
            raise ValueError("taps need at least one layer")
        self.layers = layers
        self._out: torch.Tensor | None = None

    def take(self, layer: int, x: torch.Tensor, h: torch.Tensor | None) -> None:
        """Layer `layer` is about to run on the stream x (+ h, the previous block's output
        whose residual add was left to the next norm)."""
        if layer not in self.layers:
            return
        d = x.shape[-1]
        if self._out is None:
            self._out = x.new_empty(x.shape[0], len(self.layers) * d)
        for k, at in enumerate(self.layers):  # a layer may be tapped twice
            if at == layer:
                dst = self._out[:, k * d : (k + 1) * d]
                if h is None:
                    dst.copy_(x)
                else:
                    torch.add(x, h, out=dst)

    @property
    def out(self) -> torch.Tensor:
        """[T, len(layers) * D]: what the forward it was handed to tapped."""
        if self._out is None:
            raise RuntimeError("no forward has passed these taps' layers")
        return self._out
