"""Fast CPU/pure-torch gated delta rule: a step form, a chunked form and a dispatcher.

All three have the naive reference's signature and conventions (see
`specserve.ops.naive.gated_delta`): q, k: [B, T, HK, K]; v: [B, T, HV, V];
g, beta: [B, T, HV]; state [B, HV, K, V] in the compute dtype; result
`GatedDeltaOutput(o, final_state, states)`.

- `recurrent_gated_delta_rule`: one step per token, for decode and draft verification.
  Per token it reads the state once (one bmm gives both k^T S and q^T S, using
  o_t = exp(g_t) q^T S_{t-1} + (q.k) d_t) and updates it in place (mul + rank-1 addcmul).
- `chunk_gated_delta_rule`: the UT-transform ("WY") form of fla / transformers: inside a
  chunk all corrections d_t come from one unit-lower-triangular system and a few matmuls,
  and only the chunk-to-chunk scan is sequential. Chunks are min(64, T) long, so a short
  call is not padded to 64.
- Both can return the state after every token (`output_all_states`), the snapshots that
  speculative decoding rolls back to. The chunk form writes them as
  S_t = exp(g_t) S_{t-1} + k_t d_t^T once a chunk's d_t are known; either way, writing T
  states of K*V floats per head is most of the cost for long calls.

`states` comes back as a [B, T, HV, K, V] view of a [B, HV, T, K, V] buffer (so not
contiguous when T > 1 and B * HV > 1): that layout lets every step work on one
[B*HV, K, V] batch.
Its last entry is final_state (same memory).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from specserve.ops.naive.gated_delta import (
    GatedDeltaOutput,
    initial_state_or_zeros,
    prepare_inputs,
)

CHUNK_SIZE = 64  # fla's and transformers' chunk: the triangular solves stay small

# `gated_delta_rule(mode="auto")` steps token by token up to these lengths and chunks above
# them, where each form was faster on CPU (bench/gated_delta_ops.py): without snapshots the
# step form wins up to 4 tokens and the chunked form from 8. With snapshots both forms must
# write T full states, which evens them out, and the step form stays ahead up to 16; beyond
# that, allocating and writing the states dominates both (figures: docs/perf/kernels.md).
RECURRENT_MAX_TOKENS = 4
RECURRENT_MAX_TOKENS_WITH_STATES = 16


def auto_max_recurrent(output_all_states: bool) -> int:
    """The longest call `gated_delta_rule(mode="auto")` runs in the step form."""
    return RECURRENT_MAX_TOKENS_WITH_STATES if output_all_states else RECURRENT_MAX_TOKENS


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, *] -> contiguous [B, H, T, *]: every head's tokens side by side."""
    return x.transpose(1, 2).contiguous()


def _new_states(v: torch.Tensor, k_dim: int, wanted: bool) -> torch.Tensor | None:
    """v: [B, T, H, V] -> an empty per-token state buffer [B, H, T, K, V], if wanted."""
    batch, seq_len, heads, v_dim = v.shape
    return v.new_empty((batch, heads, seq_len, k_dim, v_dim)) if wanted else None


def _finish(
    o: torch.Tensor,
    state: torch.Tensor,
    states: torch.Tensor | None,
    out_dtype: torch.dtype,
    output_final_state: bool,
) -> GatedDeltaOutput:
    """Back from head-major: o [B, H, T, V] -> [B, T, H, V]; states -> [B, T, H, K, V]."""
    o = o.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format)
    all_states = None if states is None else states.transpose(1, 2)
    return GatedDeltaOutput(o, state if output_final_state else None, all_states)


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, *] -> [T, B*H, *]: one contiguous [B*H, *] block per token."""
    return x.transpose(0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def _step_scan(
    kq: torch.Tensor,
    v_beta: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    snapshots: list[torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token loop, over rows = B*HV independent (sequence, head) pairs.

    kq: [T, rows, 2, K] (k_t and scaled q_t); v_beta: [T, rows, V]; decay = exp(g),
    beta: [T, rows]; state: [rows, K, V] (read only); snapshots: T [rows, K, V] views to
    fill with the state after each token, or None.
    Returns reads [T, rows, 2, V] = (k_t, q_t)^T S_{t-1}, delta [T, rows, V] and the final
    state [rows, K, V]. Everything per token is pre-sliced (unbind) and written with out=,
    so the loop runs four torch calls per token and no Python indexing.
    """
    seq_len, rows, _, k_dim = kq.shape
    reads = kq.new_empty((seq_len, rows, 2, v_beta.shape[-1]))
    delta = torch.empty_like(v_beta)
    step_decay = decay[:, :, None, None].unbind(0)
    minus_beta_decay = (-beta * decay)[:, :, None].unbind(0)
    k_col = kq[:, :, 0, :, None].unbind(0)
    targets = snapshots or [torch.empty_like(state)] * seq_len
    per_token = zip(kq.unbind(0), v_beta.unbind(0), reads.unbind(0), delta.unbind(0), strict=True)
    for t, (kq_t, v_beta_t, reads_t, delta_t) in enumerate(per_token):
        torch.bmm(kq_t, state, out=reads_t)
        # d_t = beta (v - exp(g) k^T S_{t-1}), and S_t = exp(g) S_{t-1} + k_t d_t^T
        torch.addcmul(v_beta_t, reads_t[:, 0], minus_beta_decay[t], out=delta_t)
        torch.mul(state, step_decay[t], out=targets[t])
        state = targets[t].addcmul_(k_col[t], delta_t[:, None, :])
    return reads, delta, state


def recurrent_gated_delta_rule(
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
    """Step form, one token at a time (the faster form for short calls).

    q, k: [B, T, HK, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; initial_state: [B, HV, K, V].
    Returns GatedDeltaOutput: o [B, T, HV, V], final_state [B, HV, K, V] | None,
    states [B, T, HV, K, V] | None.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    batch, seq_len, heads, k_dim = k.shape
    v_dim = v.shape[-1]
    # No copy: the loop never writes into the state it starts from.
    state = initial_state_or_zeros(initial_state, v, k_dim, copy=seq_len == 0)
    decay, beta = _token_major(g.exp()), _token_major(beta)
    states = _new_states(v, k_dim, output_all_states)
    snapshots = None if states is None else list(states.flatten(0, 1).unbind(1))
    reads, delta, state = _step_scan(
        _token_major(torch.stack((k, q), dim=3)),
        _token_major(v) * beta[..., None],
        decay,
        beta,
        state.view(batch * heads, k_dim, v_dim),
        snapshots,
    )
    # o_t = q_t^T S_t = exp(g_t) q_t^T S_{t-1} + (q_t . k_t) d_t, for all tokens at once.
    q_dot_k = _token_major((q * k).sum(-1, keepdim=True))
    o = torch.addcmul(q_dot_k * delta, reads[:, :, 1], decay[..., None])
    o = o.view(seq_len, batch, heads, v_dim).permute(1, 2, 0, 3)
    return _finish(o, state.view(batch, heads, k_dim, v_dim), states, out_dtype, output_final_state)


def _invert_unit_lower(a: torch.Tensor) -> torch.Tensor:
    """a: [..., C, C] -> (I + strictly_lower(a))^-1, by doubling the size of the inverted
    diagonal blocks: inv [[L11, 0], [L21, L22]] = [[X11, 0], [-X22 L21 X11, X22]].

    log2(C) rounds of batched matmuls rather than torch.linalg.solve_triangular, which
    solves a batch one small system at a time and was slower (figures: docs/perf/kernels.md).
    """
    size = a.shape[-1]
    padded = 1 << max(size - 1, 0).bit_length()  # next power of two: pairs of equal blocks
    lower = F.pad(a, (0, padded - size, 0, padded - size)).tril(-1)
    inverse = torch.eye(padded, dtype=a.dtype, device=a.device).expand_as(lower).contiguous()
    half = 1
    while half < padded:
        pairs = padded // (2 * half)

        def diagonal_blocks(x: torch.Tensor, pairs: int = pairs) -> torch.Tensor:
            """[..., P, P] -> a view [..., pairs, 2h, 2h] of the diagonal 2h x 2h blocks."""
            blocks = x.unflatten(-1, (pairs, -1)).unflatten(-3, (pairs, -1))
            return blocks.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)

        l_blocks, x_blocks = diagonal_blocks(lower), diagonal_blocks(inverse)
        below = x_blocks[..., half:, half:] @ l_blocks[..., half:, :half]
        x_blocks[..., half:, :half] = -(below @ x_blocks[..., :half, :half])
        half *= 2
    return inverse[..., :size, :size]


def _chunk_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything that does not depend on the incoming state, for all chunks at once.

    q, k: [B, H, N, C, K]; v: [B, H, N, C, V]; g, beta: [B, H, N, C] (N chunks of C tokens).
    With G = cumsum(g) inside a chunk, the corrections of a chunk starting from state S are
    d = d0 - w @ S, where (I + A) [d0 | w] = [beta v | beta k exp(G)] and
    A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i (the UT transform).
    Returns d0 [.., C, V]; reads = [w ; q exp(G)] [.., 2C, K] (both multiply S);
    intra [.., C, C] = (q_i . k_j) exp(G_i - G_j) for j <= i; k_out = k exp(G_C - G)
    [.., C, K] and chunk_decay = exp(G_C) [.., 1, 1] (the chunk's state update).
    """
    chunk = g.shape[-1]
    cum_g = g.cumsum(-1)
    # Masking before exp keeps exp(G_i - G_j) for j > i (which can overflow) out entirely.
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).triu(1)
    pair_decay = (cum_g[..., :, None] - cum_g[..., None, :]).masked_fill(above, -torch.inf).exp()
    k_beta = k * beta[..., None]
    # Only the strict lower triangle of k_beta k^T * pair_decay is A; the inverse ignores
    # the rest.
    inverse = _invert_unit_lower((k_beta @ k.transpose(-1, -2)) * pair_decay)
    d0 = inverse @ (v * beta[..., None])
    w = inverse @ (k_beta * cum_g.exp()[..., None])
    reads = torch.cat((w, q * cum_g.exp()[..., None]), dim=-2)
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    k_out = k * (cum_g[..., -1:] - cum_g).exp()[..., None]
    chunk_decay = cum_g[..., -1, None, None].exp()
    return d0, reads, intra, k_out, chunk_decay


def _snapshot_chunk(
    state: torch.Tensor,
    k: torch.Tensor,
    delta: torch.Tensor,
    decay: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """Write the state after each token of one chunk, S_t = exp(g_t) S_{t-1} + k_t d_t^T.

    state: [B, H, K, V]; k: [B, H, C, K]; delta: [B, H, C, V]; decay = exp(g): [B, H, C];
    states: [B, H, C', K, V] with C' <= C (the chunk's real, unpadded tokens).
    Returns the last state written (a view into states)."""
    per_token = zip(
        states.unbind(2),
        decay[..., None, None].unbind(2),
        k[..., None].unbind(2),
        delta[..., None, :].unbind(2),
        strict=False,  # the last chunk may have fewer real tokens than C
    )
    for target, decay_t, k_col, delta_row in per_token:
        state = torch.mul(state, decay_t, out=target).addcmul_(k_col, delta_row)
    return state


def _chunk_scan(
    k: torch.Tensor,
    g: torch.Tensor,
    terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    state: torch.Tensor,
    states: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential part: chunk after chunk, read the incoming state, then update it.

    k: [B, H, N, C, K]; g: [B, H, N, C]; terms: `_chunk_terms`' result; state:
    [B, H, K, V] (read only); states: [B, H, T, K, V] snapshot buffer (T <= N*C) or None.
    Returns o [B, H, N, C, V] and the final state [B, H, K, V].
    """
    d0, reads, intra, k_out, chunk_decay = terms
    chunk = k.shape[3]
    o = torch.empty_like(d0)
    for n in range(k.shape[2]):
        from_state = reads[:, :, n] @ state  # [B, H, 2C, V]: w S and exp(G) q^T S
        delta = d0[:, :, n] - from_state[:, :, :chunk]
        o[:, :, n] = from_state[:, :, chunk:] + intra[:, :, n] @ delta
        if states is None:
            state = state * chunk_decay[:, :, n] + k_out[:, :, n].transpose(-1, -2) @ delta
        else:
            real = states[:, :, n * chunk : (n + 1) * chunk]
            state = _snapshot_chunk(state, k[:, :, n], delta, g[:, :, n].exp(), real)
    return o, state


def chunk_gated_delta_rule(
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
    """Chunked form (chunks of min(CHUNK_SIZE, T) tokens), for prefill and long verifies.

    q, k: [B, T, HK, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; initial_state: [B, HV, K, V].
    Returns GatedDeltaOutput: o [B, T, HV, V], final_state [B, HV, K, V] | None,
    states [B, T, HV, K, V] | None.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    seq_len = q.shape[1]
    # No copy: the scan never writes into the state it starts from.
    state = initial_state_or_zeros(initial_state, v, k.shape[-1], copy=seq_len == 0)
    states = _new_states(v, k.shape[-1], output_all_states)
    chunk = max(1, min(CHUNK_SIZE, seq_len))
    # Right padding with k = v = q = 0, g = beta = 0 changes neither outputs nor state.
    pad = -seq_len % chunk
    q, k, v = (_head_major(F.pad(x, (0, 0, 0, 0, 0, pad))) for x in (q, k, v))
    g, beta = (_head_major(F.pad(x, (0, 0, 0, pad))) for x in (g, beta))
    n_chunks = q.shape[2] // chunk
    by_chunk = [x.unflatten(2, (n_chunks, chunk)) for x in (q, k, v, g, beta)]
    o, state = _chunk_scan(by_chunk[1], by_chunk[3], _chunk_terms(*by_chunk), state, states)
    return _finish(o.flatten(2, 3)[:, :, :seq_len], state, states, out_dtype, output_final_state)


def gated_delta_rule(
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
    mode: Literal["auto", "recurrent", "chunk"] = "auto",
) -> GatedDeltaOutput:
    """Gated delta rule by the form `mode` names, or with mode="auto" by the faster one
    for this call: the step form up to RECURRENT_MAX_TOKENS tokens (or
    RECURRENT_MAX_TOKENS_WITH_STATES when snapshots are wanted), the chunked form above.

    Shapes and result as `gated_delta_rule_naive`.
    """
    if mode == "auto":
        mode = "recurrent" if q.shape[1] <= auto_max_recurrent(output_all_states) else "chunk"
    if mode not in ("recurrent", "chunk"):
        raise ValueError(f"unknown gated delta mode {mode!r}")
    form = recurrent_gated_delta_rule if mode == "recurrent" else chunk_gated_delta_rule
    return form(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        output_all_states=output_all_states,
    )
