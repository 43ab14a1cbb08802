"""Fast short causal depthwise convolution with explicit state: W shifted multiply-adds.

Same signature, state convention and dtypes as `specserve.ops.naive.short_conv`: the state
is the last W - 1 inputs [B, C, W - 1]. Prepending it to the new inputs gives the whole
causal window, so prefill, decode and draft verification are the same computation, and
the per-token states are W - 1 wide sliding windows over that same buffer.

The kernel is tiny (W = 4), so the conv is W whole-tensor multiply-adds over shifted views
of the window rather than F.conv1d: on CPU, depthwise F.conv1d has no fast kernel for
bfloat16 or float64 and is far slower than the multiply-adds there; in float32 the two are
on par (figures: docs/perf/kernels.md). Each output is the same W-term sum in the same
order whatever T is, so a token's result does not depend on how many tokens share the
call. Half-precision sums run in float32 (as conv kernels do).
"""

from __future__ import annotations

import torch

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
    acc = torch.promote_types(weight.dtype, torch.float32)
    taps, wide = weight.to(acc).unbind(-1), window.to(acc)
    y = wide[..., :seq_len] * taps[0][:, None]  # [B, C, T]
    for i in range(1, len(taps)):
        y.addcmul_(wide[..., i : i + seq_len], taps[i][:, None])
    if bias is not None:
        y += bias.to(acc)[:, None]
    y = apply_activation(y.to(weight.dtype), activation).transpose(1, 2).to(x.dtype)
    final_state = window[..., seq_len:].contiguous()
    states = None
    if output_all_states:
        # unfold: [B, C, T + 1, W - 1]; entry t + 1 is the window once token t is in.
        states = window.unfold(-1, state_len, 1)[:, :, 1:].permute(0, 2, 1, 3).contiguous()
    return ConvOutput(y.contiguous(), final_state, states)
