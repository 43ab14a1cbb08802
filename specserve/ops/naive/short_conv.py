"""Reference short causal depthwise convolution with explicit state, token by token.

The Gated DeltaNet layer runs its concatenated q|k|v projections (C channels) through a
depthwise causal conv of kernel W (4 in Qwen3-Next / Qwen3.5), then SiLU:

    y_t[c] = act(bias[c] + sum_{i < W} weight[c, i] * x_{t - (W - 1) + i}[c])

State convention (shared with the fast op): the state is the last W - 1 *inputs*,
oldest first, [B, C, W - 1], zeros before the first token. That is all the next token
needs, so running T1 tokens then T2 tokens from the returned state equals running T1 + T2
at once, and the state after token t (`states[:, t]`) is exactly what a rollback to t
restores. transformers' qwen3_next / qwen3_5 cache keeps W inputs, [B, C, W], whose oldest
column `causal_conv1d_update` never uses: ours == theirs[..., 1:], and
theirs == F.pad(ours, (1, 0)) (that first column never reaches an output).

Dtypes follow transformers: the conv runs in weight's dtype and y comes back in x's dtype;
states hold raw inputs in x's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class ConvOutput(NamedTuple):
    """What the short conv ops return (unpacks as `y, final_state, states`).

    y: [B, T, C] in x's dtype.
    final_state: [B, C, W - 1], the last W - 1 inputs (oldest first).
    states: [B, T, C, W - 1], the state after each token (states[:, -1] == final_state),
        or None unless output_all_states.
    """

    y: torch.Tensor
    final_state: torch.Tensor
    states: torch.Tensor | None


def apply_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The conv's activation: "silu" (Qwen3-Next / Qwen3.5) or None."""
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r}")


def conv_initial_state(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None
) -> torch.Tensor:
    """Validate shapes and return the starting state [B, C, W - 1] in x's dtype (zeros if
    None). x: [B, T, C]; weight: [C, W] with W >= 2."""
    batch, _, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 2:
        raise ValueError(f"weight {tuple(weight.shape)} must be [C={channels}, W >= 2]")
    shape = (batch, channels, weight.shape[1] - 1)
    if initial_state is None:
        return x.new_zeros(shape)
    if tuple(initial_state.shape) != shape:
        raise ValueError(f"initial_state {tuple(initial_state.shape)} must be {shape}")
    return initial_state.to(x.dtype, copy=True)  # never an alias of the caller's state


def causal_conv1d_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    output_all_states: bool = False,
) -> ConvOutput:
    """Depthwise causal conv, one token at a time (see the module docstring).

    x: [B, T, C]; weight: [C, W]; bias: [C] or None; initial_state: [B, C, W - 1] or None.
    Returns ConvOutput(y [B, T, C], final_state [B, C, W - 1], states [B, T, C, W - 1] | None).
    """
    state = conv_initial_state(x, weight, initial_state)
    y = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    states = x.new_empty(x.shape + state.shape[-1:]) if output_all_states else None
    for t in range(x.shape[1]):
        window = torch.cat((state, x[:, t, :, None]), dim=-1)  # [B, C, W], oldest first
        y[:, t] = (window.to(weight.dtype) * weight).sum(-1)
        if bias is not None:
            y[:, t] += bias
        state = window[..., 1:]
        if states is not None:
            states[:, t] = state
    return ConvOutput(apply_activation(y, activation).to(x.dtype), state.contiguous(), states)
