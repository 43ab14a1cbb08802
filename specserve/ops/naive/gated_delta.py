"""Reference gated delta rule (the recurrence inside a Gated DeltaNet layer), token by token.

Per sequence and value head, with a state S: [K, V] and log decay g_t <= 0:

    S    = S * exp(g_t)                 # forget
    pred = k_t^T S                      # [V]: what the memory recalls for k_t
    d_t  = beta_t * (v_t - pred)        # the delta rule: write only the correction
    S    = S + k_t (outer) d_t
    o_t  = (scale * q_t)^T S            # read with the *updated* state

This is the math of transformers' `torch_recurrent_gated_delta_rule` (qwen3_next /
qwen3_5) and of flash-linear-attention's naive reference, in the same order: optional
l2norm of q and k (eps inside the rsqrt), then q scaled by `scale` (default K ** -0.5).

Conventions shared by every gated delta op in specserve (naive and fast):
- q, k: [B, T, HK, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; HV must be a multiple of
  HK, and q/k head h serves the HV // HK consecutive value heads h * (HV // HK) + i
  (transformers' `repeat_interleave` grouping).
- state: [B, HV, K, V] (key-major, like transformers and fla), kept in the compute dtype:
  float32 for bfloat16/float16/float32 inputs (what transformers does), float64 for
  float64 inputs. `o` comes back in q's dtype.
- `initial_state` is never modified in place: rollback by checkpoint relies on that.
- A token with g = 0 and beta = 0 leaves the state unchanged (bit for bit in the step
  form; to rounding in the chunked form, whose chunk length follows T), so sequences of
  different lengths can be right-padded into one batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

L2NORM_EPS = 1e-6  # transformers' and fla's value, inside the rsqrt


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x: [..., D] -> x / sqrt(sum(x^2) + eps) over the last dim (transformers' formula)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the recurrence runs and keeps its state in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def prepare_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate shapes, widen to the compute dtype, share q/k heads across value heads,
    l2-normalize (optional) and scale q. Layout stays [B, T, H, *]; every head is HV."""
    batch, seq_len, n_qk_heads, k_dim = k.shape
    n_v_heads = v.shape[2]
    if q.shape != k.shape or v.shape[:2] != (batch, seq_len) or n_v_heads % n_qk_heads:
        raise ValueError(f"bad shapes: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if g.shape != (batch, seq_len, n_v_heads) or beta.shape != g.shape:
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [B, T, HV]")
    dtype = compute_dtype(q.dtype)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if n_v_heads != n_qk_heads:
        q = q.repeat_interleave(n_v_heads // n_qk_heads, dim=2)
        k = k.repeat_interleave(n_v_heads // n_qk_heads, dim=2)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (k_dim**-0.5 if scale is None else scale)
    return q, k, v, g, beta


def initial_state_or_zeros(
    initial_state: torch.Tensor | None, v: torch.Tensor, k_dim: int, copy: bool = True
) -> torch.Tensor:
    """The starting state [B, HV, K, V] in v's (compute) dtype. A copy, unless copy=False
    (then it may alias initial_state, for callers that only read it)."""
    batch, _, n_heads, v_dim = v.shape
    shape = (batch, n_heads, k_dim, v_dim)
    if initial_state is None:
        return v.new_zeros(shape)
    if tuple(initial_state.shape) != shape:
        raise ValueError(f"initial_state {tuple(initial_state.shape)} must be {shape}")
    return initial_state.to(dtype=v.dtype, device=v.device, copy=copy)


class GatedDeltaOutput(NamedTuple):
    """What every gated delta op returns (unpacks as `o, final_state, states`).

    o: [B, T, HV, V] in q's dtype.
    final_state: [B, HV, K, V] in the compute dtype, or None unless output_final_state.
    states: [B, T, HV, K, V], the state after each token (states[:, t] is the state once
        token t is consumed; states[:, -1] equals final_state), or None unless
        output_all_states. Speculative decoding keeps states[:, n_accepted] on rollback.
    """

    o: torch.Tensor
    final_state: torch.Tensor | None
    states: torch.Tensor | None


def gated_delta_rule_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    output_all_states: bool = False,
) -> GatedDeltaOutput:
    """Gated delta rule, one token at a time (see the module docstring for the math).

    q, k: [B, T, HK, K]; v: [B, T, HV, V]; g (log decay), beta: [B, T, HV];
    initial_state: [B, HV, K, V] or None (zeros).
    Returns GatedDeltaOutput(o, final_state, states); see there for shapes.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    state = initial_state_or_zeros(initial_state, v, k.shape[-1])
    o = torch.empty_like(v)
    states = v.new_empty(v.shape[:3] + state.shape[-2:]) if output_all_states else None
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, :, None, None]
        recalled = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        delta = (v[:, t] - recalled) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)
        if states is not None:
            states[:, t] = state
    return GatedDeltaOutput(o.to(out_dtype), state if output_final_state else None, states)
