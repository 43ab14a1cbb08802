"""Reference attention over a slot-indexed KV cache, one sequence at a time.

Readable and exact: each sequence attends to its own slot's cached keys with a causal
(and optionally sliding-window) mask built from absolute positions. Faster forms keep
this signature and are tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.batch import FlatBatch


def visible_mask(
    q_pos: torch.Tensor, kv_len: int, window: int | None, at: torch.Tensor | None = None
) -> torch.Tensor:
    """q_pos: [n] absolute positions -> [n, kv_len] bool, True where key j may be attended.

    Causal: j <= p. Sliding window of size w: p - j < w (the key w positions back is out).
    at: [n] where each row's own key is stored, where that is not its position (an
    alternative, batch.py `branches`): the row sees the keys before p and its own.
    """
    j = torch.arange(kv_len, device=q_pos.device)[None, :]
    p = q_pos[:, None]
    mask = j <= p if at is None else (j < p) | (j == at[:, None])
    if window is not None:
        mask &= (p - j) < window
    return mask


def cached_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: FlatBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k_cache, v_cache: [n_slots, max_len, Hkv, D] already holding the batch's
    new keys -> [T, H, D]. Grouped-query heads share kv head h // (H // Hkv)."""
    out = torch.empty_like(q)
    cu = batch.cu_seqlens
    for i, (slot, start) in enumerate(zip(batch.slots, batch.starts, strict=True)):
        rows = slice(cu[i], cu[i + 1])
        kv_len = start + (cu[i + 1] - cu[i])
        at = batch.rows_at[rows] if batch.branches else None
        mask = visible_mask(batch.positions[rows], kv_len, window, at)
        qi = q[rows].transpose(0, 1)  # [H, n, D]
        ki = k_cache[slot, :kv_len].transpose(0, 1)  # [Hkv, L, D]
        vi = v_cache[slot, :kv_len].transpose(0, 1)
        oi = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[rows] = oi.transpose(0, 1)
    return out
