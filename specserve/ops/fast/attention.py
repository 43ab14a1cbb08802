"""Attention over the slot KV cache for decode and verification (1..64 new tokens a slot).

Same signature and result as ops/naive/attention.py, cheaper on CPU. float32 on a CPU
runs ops/cpu/attention.cpp when it builds: every row alone, so batch-invariant whatever
`per_row` says. Otherwise SDPA, with:
- grouped-query heads are folded into the query rows ([Hkv, group * n, D]) instead of
  repeating K and V per query head, so no copy of the cache is made;
- a single new token with no sliding window needs no mask at all.

`per_row=True` is the batch-invariant form: every query row is computed alone against its
own causal prefix of the cache, exactly as plain one-token decoding computes it, so a
row's result cannot depend on how many rows (draft tokens, other slots) share the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.batch import FlatBatch
from specserve.ops.cpu.build import kernels_for
from specserve.ops.naive.attention import visible_mask


def cached_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: FlatBatch,
    scale: float,
    window: int | None = None,
    per_row: bool = False,
) -> torch.Tensor:
    """q: [T, H, D]; k_cache, v_cache: [n_slots, max_len, Hkv, D] -> [T, H, D]."""
    kernels = kernels_for(q) if k_cache.dtype == torch.float32 else None
    if kernels is not None and q.shape[-1] % 64 == 0:
        return kernels.cached_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            batch.slots,
            batch.starts,
            batch.cu_seqlens,
            batch.positions,
            scale,
            window or 0,
        )
    if per_row:
        return _per_row(q, k_cache, v_cache, batch, scale, window)
    T, H, D = q.shape
    hkv = k_cache.shape[2]
    group = H // hkv
    out = torch.empty_like(q)
    cu = batch.cu_seqlens
    for i, (slot, start) in enumerate(zip(batch.slots, batch.starts, strict=True)):
        n = cu[i + 1] - cu[i]
        kv_len = start + n
        lo = 0 if window is None else max(0, kv_len - n - window + 1)
        # query head h = kv * group + j  ->  rows [kv, j * n + t]
        qi = (
            q[cu[i] : cu[i + 1]]
            .view(n, hkv, group, D)
            .permute(1, 2, 0, 3)
            .reshape(hkv, group * n, D)
        )
        ki = k_cache[slot, lo:kv_len].transpose(0, 1)  # [Hkv, L, D]
        vi = v_cache[slot, lo:kv_len].transpose(0, 1)
        mask = None
        if n > 1 or window is not None or batch.branches:
            at = batch.rows_at[cu[i] : cu[i + 1]] if batch.branches else None
            m = visible_mask(batch.positions[cu[i] : cu[i + 1]], kv_len, window, at)[:, lo:]
            mask = m.repeat(group, 1)  # [group * n, L], same for every kv head
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[cu[i] : cu[i + 1]] = oi.view(hkv, group, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out


def _per_row(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: FlatBatch,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    row = 0
    for slot, start, n in zip(batch.slots, batch.starts, batch.lens(), strict=True):
        for t in range(n):
            pos = batch.positions[row : row + 1]
            # an alternative is stored past its position (batch.py `branches`)
            branch = ((int(pos) - start - 1,),) if int(pos) != start + t else ()
            one = FlatBatch([slot], [start + t], [0, 1], pos, branches=branch)
            out[row : row + 1] = cached_attention(
                q[row : row + 1], k_cache, v_cache, one, scale, window
            )
            row += 1
    return out
