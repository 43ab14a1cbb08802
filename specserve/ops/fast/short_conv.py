"""Fast short causal depthwise convolution with explicit state: one F.conv1d per call.

Same signature, state convention and dtypes as `specserve.ops.naive.short_conv`: the state
is the last W - 1 inputs [B, C, W - 1]. Prepending it to the new inputs gives the whole
causal window, so prefill, decode and draft verification are the same single conv, and
the per-token states are W - 1 wide sliding windows over that same buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.ops.naive.short_conv import ConvOutput, apply_activation, conv_initial_state


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    output_all_states: bool = False,
) -> ConvOutput:
    """Depthwise causal conv over a whole call at once.

    x: [B, T, C]; weight: [C, W]; bias: [C] or None; initial_state: [B, C, W - 1] or None.
    Returns ConvOutput(y [B, T, C], final_state [B, C, W - 1], states [B, T, C, W - 1] | None).
    """
    state = conv_initial_state(x, weight, initial_state)
    seq_len, state_len = x.shape[1], state.shape[-1]
    window = torch.cat((state, x.transpose(1, 2)), dim=-1)  # [B, C, W - 1 + T]
    if seq_len > 0:
        y = F.conv1d(window.to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])
        y = apply_activation(y, activation).transpose(1, 2).to(x.dtype)
    else:  # conv1d rejects a window shorter than its kernel
        y = x.clone()
    final_state = window[..., seq_len:].contiguous()
    states = None
    if output_all_states:
        # unfold: [B, C, T + 1, W - 1]; entry t + 1 is the window once token t is in.
        states = window.unfold(-1, state_len, 1)[:, :, 1:].permute(0, 2, 1, 3).contiguous()
    return ConvOutput(y.contiguous(), final_state, states)
