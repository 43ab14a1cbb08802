"""Verification of drafts against the target: which draft tokens are kept, and what comes next.

One verify forward gives the target's distribution at every position of `[last, d1..dk]`:
row i is p(. | context, d1..di), the distribution of the token at draft position i + 1.
From those k + 1 rows and the draft, one slot keeps

- accepted tokens: the longest prefix d1..dn of the draft that the target keeps;
- a recovered token: when d_{n+1} is rejected, the token the target emits in its place;
- a bonus token: when all k drafts are accepted, a token sampled from row k, for free.

So every verification emits `accepted + 1` tokens and never changes what the target would
have produced. `verify` is the one entry point; it picks one of four rules (naming after
vLLM's v1/sample/rejection_sampler.py):

- greedy: accept while argmax(row i) == d_{i+1}; emit the argmax at the first mismatch.
- sampled (drafts without probabilities, e.g. n-gram): sample every row from p with the
  randomness non-speculative decoding would use at that position, and accept while the
  sample equals the draft. The emitted tokens are *identical* to decoding without drafts.
- rejection (drafts with probabilities q, Leviathan et al., "Fast Inference from
  Transformers via Speculative Decoding", arXiv 2211.17192): accept d_i with probability
  min(1, p(d_i) / q(d_i)); on rejection emit a sample from norm(max(p - q, 0)). Each
  emitted token is distributed exactly as p (the output *distribution* equals the target's).
- constrained (a grammar the output follows, e.g. JSON mode): row i picks what plain
  constrained decoding would pick in the grammar's state after d1..di, and the draft is
  kept while the picks equal it; identical to decoding without drafts, as "sampled".

Randomness is counter-based: the uniform a decision uses is a hash of (seed, absolute
position of the token being decided, stream), never a draw from a stateful generator. So
the randomness behind the token at position t does not depend on the batch, on the draft
length, or on how many random numbers were used before; this is what makes "sampled"
verification reproduce non-speculative sampling token for token.

This module sits in speculative/, which never imports engine/; engine/sampling.py builds
the target distributions and re-uses the primitives below for ordinary sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import numpy as np
import torch

from specserve.errors import SpecserveError
from specserve.speculative.base import Draft


class Stream(IntEnum):
    """Independent random streams per (seed, position); one per kind of decision."""

    SAMPLE = 0  # the target's own sample (the only stream non-speculative decoding uses)
    ACCEPT = 1  # the coin that accepts a draft token that came with draft probabilities
    RECOVER = 2  # the sample from norm(max(p - q, 0)) after such a token is rejected
    RETRY = 3  # constrained decoding's draw from the allowed tokens, after a disallowed one
    DRAFT = 4  # a drafter's own sample from its distribution q (speculative/mtp.py)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 (Steele, Lea & Flood 2014): a bijective 64-bit mixer; uint64 arrays wrap."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def position_uniforms(
    seeds: Sequence[int],
    positions: Sequence[int],
    stream: int = Stream.SAMPLE,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Uniforms in (0, 1), one per (seed, position) pair, for the given stream.

    seeds, positions: [N] (position = absolute index of the token being decided).
    Returns: [N] float64. A pure function of its arguments, identical on every device.
    """
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds for {len(positions)} positions")
    s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)
    p = np.array([x & _MASK64 for x in positions], dtype=np.uint64)
    h = _mix64(_mix64(_mix64(s) ^ p) ^ np.uint64(int(stream)))
    # 52 random bits, offset by half a step: never exactly 0 or 1
    u = (h >> np.uint64(12)).astype(np.float64) * 2.0**-52 + 2.0**-53
    return torch.from_numpy(u).to(device)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row n gives the first token whose cumulative mass exceeds u[n].

    probs: [N, V] non-negative, need not be normalised (each row must have some mass).
    u: [N] uniforms in (0, 1). Returns: [N] int64.
    One uniform per row (not V as Gumbel-max needs) keeps the randomness a cheap scalar per
    position; float64 accumulation keeps the CDF faithful for large vocabularies.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    x = u.to(cdf).unsqueeze(-1) * total
    # u * total may round up to total; stay strictly below so zero-mass tails are never hit
    x = torch.minimum(x, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)


def _sample_row(p: torch.Tensor, seed: int, position: int, stream: Stream) -> int:
    """p: [V]; one token drawn with the (seed, position, stream) uniform."""
    u = position_uniforms([seed], [position], stream, p.device)
    return int(sample_from_probs(p.unsqueeze(0), u)[0])


@dataclass
class VerifyResult:
    """What one slot keeps: `tokens` = accepted drafts + one recovered or bonus token.
    branch: which of the draft's alternatives was kept in place of the draft token it stands
    in for (counted in `accepted`, its own row giving the last token), None where none was."""

    accepted: int
    tokens: list[int]
    branch: int | None = None


# ---- the entry point ---------------------------------------------------------------------


class Constraint(Protocol):
    """The grammar a request's output follows, as verification and drafting ask it
    (grammar/constraint.py, on llguidance). Questions are about the current state: the
    output emitted so far (`feed`) and the tokens pushed on trial while a draft is judged
    (`push`, taken back by `settle`)."""

    def allows(self, token: int) -> bool:
        """Whether `token` may come next."""
        ...

    def mask(self, size: int) -> torch.Tensor:
        """[size] bool: every token that may come next."""
        ...

    def push(self, token: int) -> None:
        """Move the state by an allowed token, on trial."""
        ...

    def settle(self) -> None:
        """Take back the tokens pushed on trial."""
        ...

    def feed(self, tokens: Sequence[int]) -> None:
        """Emitted tokens move the state."""
        ...

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many leading tokens of `draft` may come next."""
        ...

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would say."""
        ...


def verify(
    logits: torch.Tensor,
    draft: Draft,
    *,
    probs: torch.Tensor | None,
    seed: int,
    position: int,
    constraint: Constraint | None = None,
) -> VerifyResult:
    """One slot's verification: every rule behind this one call.

    logits: [k + 1, V] the target's rows for [last, d1..dk], penalised and biased, then a
        row for each of the draft's alternatives (greedy only: `verify_greedy`).
    probs: [k + 1, V] the distribution the request samples from (engine/sampling.py
        `probs_from_logits`), or None for greedy.
    seed, position: the request's seed and the absolute position of the first token this
        step emits (row i decides position + i).
    constraint: the grammar the output follows, if any.

    Greedy without a constraint takes the argmax of the logits: what one-hot probs would
    reduce every rule to (tested), without a softmax and a vocabulary-wide CDF per row.
    """
    if probs is None and constraint is None:
        return verify_greedy(logits, draft.tokens, draft.alternatives, draft.alt_at)
    if draft.alternatives:
        raise ValueError("alternatives are verified for greedy requests without a grammar only")
    if constraint is not None:
        return verify_constrained(constraint, logits, probs, draft.tokens, seed, position)
    assert probs is not None  # greedy without a grammar returned above
    if draft.probs is None:
        return verify_sampled(probs, draft.tokens, seed, position)
    return verify_rejection(probs, draft.tokens, draft.probs, seed, position)


# ---- the rules --------------------------------------------------------------------------


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """logits: [N, V] -> the first argmax of each row (torch.argmax's answer).

    Float rows on the CPU go through numpy: its SIMD argmax reads a vocabulary-wide row far
    faster than torch's (figures: docs/perf/kernels.md). It answers ties (the first index)
    and NaN (the first NaN) as torch does."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def ranked_ids(x: np.ndarray, k: int) -> list[int]:
    """x: [V] scores -> the ids scoring at least the k-th highest (all ties at that score,
    so ties are never split), highest first and ties by id: `argmax_rows`'s order."""
    k = min(k, len(x))
    floor = np.partition(x, len(x) - k)[len(x) - k]
    return sorted(np.flatnonzero(x >= floor).tolist(), key=lambda t: (-x[t], t))


def verify_greedy(
    target_logits: torch.Tensor,
    draft: Sequence[int],
    alternatives: Sequence[int] = (),
    alt_at: Sequence[int] = (),
) -> VerifyResult:
    """Greedy verification of one slot.

    target_logits: [k + 1 + m, V] rows for [last, d1..dk, a1..am]; draft: [k] tokens d1..dk;
    alternatives: [m] tokens a1..am, a_j another guess in place of d_{alt_at[j] + 1}, its
    row computed as if it stood there (batch.py `branches`). Where the draft is kept up to
    d_i and d_{i+1} is wrong, an a_j in its place that is the target's token is kept, and
    its row gives the next token: a token tree whose side branches are one token long (as
    SpecInfer's and EAGLE's trees, every path is what plain decoding computes).
    """
    k, m = len(draft), len(alternatives)
    _check_rows(target_logits, k + m)
    best = argmax_rows(target_logits)
    n = 0
    while n < k and best[n] == draft[n]:
        n += 1
    for j, (a, i) in enumerate(zip(alternatives, alt_at, strict=True)):
        if n < k and i == n and a == best[n]:
            return VerifyResult(n + 1, [*draft[:n], a, best[k + 1 + j]], branch=j)
    return VerifyResult(n, [*draft[:n], best[n]])


def verify_sampled(
    target_probs: torch.Tensor, draft: Sequence[int], seed: int, position: int
) -> VerifyResult:
    """Verification of a draft without probabilities: sample the target, compare.

    target_probs: [k + 1, V]; draft: [k]; position: absolute position of the first token
    this step emits (row i decides position + i).
    """
    _check_rows(target_probs, len(draft))
    for i in range(len(draft) + 1):
        token = _sample_row(target_probs[i], seed, position + i, Stream.SAMPLE)
        if i == len(draft) or token != draft[i]:
            return VerifyResult(i, [*draft[:i], token])
    raise AssertionError("unreachable")


def verify_rejection(
    target_probs: torch.Tensor,
    draft: Sequence[int],
    draft_probs: torch.Tensor,
    seed: int,
    position: int,
) -> VerifyResult:
    """Rejection sampling (Leviathan et al.) for a draft with probabilities.

    target_probs: [k + 1, V] p; draft: [k] tokens, each drawn from its row of
    draft_probs: [k, V] q. position: as in `verify_sampled`.
    """
    k = len(draft)
    _check_rows(target_probs, k)
    if draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} for a {k}-token draft")
    for i, d in enumerate(draft):
        p, q = target_probs[i].to(torch.float64), draft_probs[i].to(torch.float64)
        u = float(position_uniforms([seed], [position + i], Stream.ACCEPT)[0])
        if u * float(q[d]) < float(p[d]):  # u < p/q without dividing by a zero q
            continue
        token = _sample_row(_residual(p, q), seed, position + i, Stream.RECOVER)
        return VerifyResult(i, [*draft[:i], token])
    bonus = _sample_row(target_probs[k], seed, position + k, Stream.SAMPLE)
    return VerifyResult(k, [*draft, bonus])


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0) over [..., V]; rows left without mass (p == q up to rounding) fall back
    to p: rejection is then (almost) impossible, and p is the right limit."""
    r = (p - q).clamp_min(0)
    return torch.where(r.sum(dim=-1, keepdim=True) > 0, r, p)


def _check_rows(rows: torch.Tensor, k: int) -> None:
    if rows.dim() != 2 or rows.shape[0] != k + 1:
        raise ValueError(f"need [k + 1, V] = [{k + 1}, V] target rows, got {tuple(rows.shape)}")


# ---- constrained: the output follows a grammar --------------------------------------------


def verify_constrained(
    constraint: Constraint,
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    draft: Sequence[int],
    seed: int,
    position: int,
) -> VerifyResult:
    """Row i is judged in the grammar's state after d1..di (pushed on trial, taken back
    after), the state plain decoding would be in there, and its pick depends only on its
    row, that state and its position's randomness: so any draft (with probabilities too)
    is verified exactly by comparing.

    logits: [k + 1, V]; probs: their sampling distribution, None for greedy.
    """
    tokens: list[int] = []
    try:
        for i in range(len(draft) + 1):
            p = None if probs is None else probs[i]
            token = pick_constrained(constraint, logits[i], p, seed, position + i)
            tokens.append(token)
            if i == len(draft) or token != draft[i]:
                break
            constraint.push(token)
    finally:
        constraint.settle()
    return VerifyResult(len(tokens) - 1, tokens)


def pick_constrained(
    constraint: Constraint, row: torch.Tensor, p: torch.Tensor | None, seed: int, position: int
) -> int:
    """One row's token under the grammar (p: the row's distribution, None for greedy).

    The row picks as unconstrained decoding would, and only if the grammar forbids that
    token is a vocabulary mask asked for: greedy then takes the allowed token of highest
    score, sampling draws again from p restricted to the allowed tokens (stream RETRY).
    A forbidden first draw and the masked redraw together give p(t) / p(allowed): exactly
    the restricted distribution, and most rows pay one membership test, not a mask. With
    no allowed mass (top-k / top-p left none) the allowed token of highest score."""
    if p is None:
        token = argmax_rows(row.unsqueeze(0))[0]
    else:
        token = _sample_row(p, seed, position, Stream.SAMPLE)
    if constraint.allows(token):
        return token
    mask = constraint.mask(row.shape[-1]).to(row.device)
    if p is not None:
        kept = torch.where(mask, p.to(torch.float64), 0.0)
        if kept.sum() > 0:
            return _sample_row(kept, seed, position, Stream.RETRY)
    token = int(torch.where(mask, row, float("-inf")).argmax())
    if not constraint.allows(token):  # a dead end: no token of this vocabulary spells on
        raise SpecserveError("the grammar allows no token of this vocabulary here")
    return token
