"""Log-probabilities of emitted tokens (OpenAI's `logprobs` / `top_logprobs`).

They are the target's own distribution at each position: log_softmax of the raw logits,
before penalties, logit_bias and temperature (vLLM's default, "raw_logprobs"), so they
describe the model, not the request's sampling settings.

With speculation a token's row is a verification row [last, d1..dk] of the step that kept
it; without, a one-row decode step. The model gives a row the same logits either way (the
batch-exactness tests), and each row is reduced here alone, in numpy (pairwise sums in
float64, one thread), so the figures do not depend on how many rows sat beside it nor on the
thread count the last forward ran with: speculation on gives what speculation off gives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.speculative.verify import ranked_ids

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token, its log-probability, and the `n` most likely tokens at its
    position (most likely first; ties by token id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(rows: torch.Tensor, tokens: Sequence[int], n_top: int) -> list[TokenLogprob]:
    """rows: [>= len(tokens), V] raw logits, row i the one that decided tokens[i]."""
    if not 0 <= n_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {n_top}")
    return [_one(rows[i], tok, n_top) for i, tok in enumerate(tokens)]


def _one(row: torch.Tensor, token: int, n_top: int) -> TokenLogprob:
    x = row.detach().cpu().numpy()
    peak = x.max()
    # exp in the row's own precision (float32: 8 lanes, far faster than float64's exp;
    # figures: docs/perf/kernels.md), summed in float64
    lse = float(peak) + math.log(np.exp(x - peak).sum(dtype=np.float64))
    logprob = float(x[token]) - lse
    if n_top == 0:
        return TokenLogprob(token, logprob)
    best = ranked_ids(x, n_top)[:n_top]
    return TokenLogprob(token, logprob, tuple((t, float(x[t]) - lse) for t in best))
