"""Verification of drafts against the target: which draft tokens are kept, and what comes next.

One verify forward gives the target's distribution at every position of `[last, d1..dk]`:
row i is p(. | context, d1..di), the distribution of the token at draft position i + 1.
From those k + 1 rows and the draft, one slot keeps

- accepted tokens: the longest prefix d1..dn of the draft that the target keeps;
- a recovered token: when d_{n+1} is rejected, the token the target emits in its place;
- a bonus token: when all k drafts are accepted, a token sampled from row k, for free.

So every verification emits `accepted + 1` tokens and never changes what the target would
have produced. Three rules (naming after vLLM's v1/sample/rejection_sampler.py):

- greedy: accept while argmax(row i) == d_{i+1}; emit the argmax at the first mismatch.
- sampled (drafts without probabilities, e.g. n-gram): sample every row from p with the
  randomness non-speculative decoding would use at that position, and accept while the
  sample equals the draft. The emitted tokens are *identical* to decoding without drafts.
- rejection (drafts with probabilities q, Leviathan et al., "Fast Inference from
  Transformers via Speculative Decoding", arXiv 2211.17192): accept d_i with probability
  min(1, p(d_i) / q(d_i)); on rejection emit a sample from norm(max(p - q, 0)). Each
  emitted token is distributed exactly as p (the output *distribution* equals the target's).

Randomness is counter-based: the uniform a decision uses is a hash of (seed, absolute
position of the token being decided, stream), never a draw from a stateful generator. So
the randomness behind the token at position t does not depend on the batch, on the draft
length, or on how many random numbers were used before; this is what makes "sampled"
verification reproduce non-speculative sampling token for token.

This module sits in spec/ because spec/ never imports engine/; engine/sampling.py builds
the target distributions and re-uses the primitives below for ordinary sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from specserve.speculative.base import Draft


class Stream(IntEnum):
    """Independent random streams per (seed, position); one per kind of decision."""

    SAMPLE = 0  # the target's own sample (the only stream non-speculative decoding uses)
    ACCEPT = 1  # the coin that accepts a draft token that came with draft probabilities
    RECOVER = 2  # the sample from norm(max(p - q, 0)) after such a token is rejected
    RETRY = 3  # RETRY + r: constrained decoding's draw r after r disallowed draws


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
    """What one slot keeps: `tokens` = accepted drafts + one recovered or bonus token."""

    accepted: int
    tokens: list[int]


# ---- one slot: the readable references ----------------------------------------------------


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


def verify_greedy(target_logits: torch.Tensor, draft: Sequence[int]) -> VerifyResult:
    """Greedy verification of one slot.

    target_logits: [k + 1, V] rows for [last, d1..dk]; draft: [k] tokens d1..dk.
    """
    _check_rows(target_logits, len(draft))
    best = argmax_rows(target_logits)
    n = 0
    while n < len(draft) and best[n] == draft[n]:
        n += 1
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


def verify_slot(target_probs: torch.Tensor, draft: Draft, seed: int, position: int) -> VerifyResult:
    """One slot, the rule chosen by whether the draft carries probabilities.

    target_probs: [k + 1, V]. A greedy slot passes one-hot rows (as `probs_from_logits`
    gives for temperature 0): both rules then reduce exactly to `verify_greedy`.
    """
    if draft.probs is None:
        return verify_sampled(target_probs, draft.tokens, seed, position)
    return verify_rejection(target_probs, draft.tokens, draft.probs, seed, position)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0) over [..., V]; rows left without mass (p == q up to rounding) fall back
    to p: rejection is then (almost) impossible, and p is the right limit."""
    r = (p - q).clamp_min(0)
    return torch.where(r.sum(dim=-1, keepdim=True) > 0, r, p)


def _check_rows(rows: torch.Tensor, k: int) -> None:
    if rows.dim() != 2 or rows.shape[0] != k + 1:
        raise ValueError(f"need [k + 1, V] = [{k + 1}, V] target rows, got {tuple(rows.shape)}")


# ---- many slots: the flat batched form ------------------------------------------------------


@dataclass
class FlatDrafts:
    """All slots' drafts of one step, concatenated (vLLM's flat layout).

    tokens: [D] int64, D = sum_b k_b; slot b owns tokens[cu[b]:cu[b + 1]].
    cu: [B + 1] cumulative draft lengths, cu[0] = 0 (host-side metadata).
    probs: [D, V] draft probabilities, or None when no slot has any; the rows of slots
        without probabilities are zeros and are never read.
    has_probs: [B] whether slot b's rows of `probs` are real.

    The matching target rows are [D + B, V]: slot b owns rows cu[b] + b .. cu[b + 1] + b,
    its k_b draft rows followed by its bonus row.
    """

    tokens: torch.Tensor
    cu: list[int]
    probs: torch.Tensor | None
    has_probs: list[bool]

    @classmethod
    def from_drafts(
        cls, drafts: Sequence[Draft], device: torch.device | str | None = None
    ) -> FlatDrafts:
        cu = [0]
        for d in drafts:
            cu.append(cu[-1] + len(d))
        tokens = torch.tensor([t for d in drafts for t in d.tokens], dtype=torch.long)
        has_probs = [d.probs is not None for d in drafts]
        for d in drafts:
            if d.probs is not None and (d.probs.dim() != 2 or d.probs.shape[0] != len(d)):
                raise ValueError(f"draft probs {tuple(d.probs.shape)} for a {len(d)}-token draft")
        probs = None
        with_probs = [d.probs for d in drafts if d.probs is not None]
        if with_probs:
            probs = torch.zeros(cu[-1], with_probs[0].shape[-1], dtype=with_probs[0].dtype)
            for b, d in enumerate(drafts):
                if d.probs is not None:
                    probs[cu[b] : cu[b + 1]] = d.probs.to(probs)
            probs = probs.to(device)
        return cls(tokens.to(device), cu, probs, has_probs)

    @property
    def num_slots(self) -> int:
        return len(self.cu) - 1


@dataclass
class _RowLayout:
    """Per target row its slot's seed and the position it decides ([D + B] each), and the
    target row of each draft token ([D])."""

    seeds: list[int]
    positions: list[int]
    draft_rows: list[int]

    @classmethod
    def of(cls, drafts: FlatDrafts, seeds: Sequence[int], positions: Sequence[int]) -> _RowLayout:
        layout = cls([], [], [])
        for b in range(drafts.num_slots):
            k = drafts.cu[b + 1] - drafts.cu[b]
            layout.seeds += [seeds[b]] * (k + 1)
            layout.positions += range(positions[b], positions[b] + k + 1)
            layout.draft_rows += range(drafts.cu[b] + b, drafts.cu[b + 1] + b)
        return layout


def verify_batch(
    target_probs: torch.Tensor,
    drafts: FlatDrafts,
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[VerifyResult]:
    """Verify every slot at once; equals `verify_slot` slot by slot (tested).

    target_probs: [D + B, V] in the layout of `FlatDrafts` (greedy slots: one-hot rows).
    seeds, positions: [B] each slot's seed and the absolute position of its first
    emitted token. Returns one VerifyResult per slot; verdicts come back in one copy.
    """
    b_count, d_count = drafts.num_slots, drafts.cu[-1]
    if len(seeds) != b_count or len(positions) != b_count:
        raise ValueError(f"{b_count} slots, {len(seeds)} seeds, {len(positions)} positions")
    if target_probs.dim() != 2 or target_probs.shape[0] != d_count + b_count:
        raise ValueError(f"need [D + B, V] = [{d_count + b_count}, V] target rows")
    layout = _RowLayout.of(drafts, seeds, positions)
    u = position_uniforms(layout.seeds, layout.positions, Stream.SAMPLE, target_probs.device)
    samples = sample_from_probs(target_probs, u)  # [D + B]
    accepted, emitted = _judge_drafts(target_probs, drafts, samples, layout)
    host = torch.cat([accepted.long(), emitted, samples]).tolist()
    acc, emit, samp = host[:d_count], host[d_count : 2 * d_count], host[2 * d_count :]
    tokens = drafts.tokens.tolist()
    results = []
    for b in range(b_count):
        lo, hi = drafts.cu[b], drafts.cu[b + 1]
        n = 0
        while lo + n < hi and acc[lo + n]:
            n += 1
        last = emit[lo + n] if lo + n < hi else samp[hi + b]
        results.append(VerifyResult(n, [*tokens[lo : lo + n], last]))
    return results


def _judge_drafts(
    target_probs: torch.Tensor,
    drafts: FlatDrafts,
    samples: torch.Tensor,
    layout: _RowLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per draft token: accepted? ([D] bool) and the token to emit if it is not ([D] int64).

    Without draft probabilities: the target's sample is the verdict and the replacement.
    With them: the min(1, p/q) coin and a sample of the residual (Leviathan et al.).
    """
    device = target_probs.device
    d = drafts.tokens.to(device)
    rows = torch.tensor(layout.draft_rows, dtype=torch.long, device=device)
    emitted = samples[rows]
    accepted = emitted == d
    slot_of = [b for b in range(drafts.num_slots) for _ in range(drafts.cu[b], drafts.cu[b + 1])]
    judged = [j for j, b in enumerate(slot_of) if drafts.has_probs[b]]
    if drafts.probs is None or not judged:
        return accepted, emitted
    idx = torch.tensor(judged, dtype=torch.long, device=device)
    p = target_probs[rows[idx]].to(torch.float64)  # [R, V]
    q = drafts.probs.to(device)[idx].to(torch.float64)  # [R, V]
    tok = d[idx].unsqueeze(-1)
    j_rows = [layout.draft_rows[j] for j in judged]
    j_seeds = [layout.seeds[r] for r in j_rows]
    j_positions = [layout.positions[r] for r in j_rows]
    u = position_uniforms(j_seeds, j_positions, Stream.ACCEPT, device)
    accepted[idx] = u * q.gather(-1, tok).squeeze(-1) < p.gather(-1, tok).squeeze(-1)
    u = position_uniforms(j_seeds, j_positions, Stream.RECOVER, device)
    emitted[idx] = sample_from_probs(_residual(p, q), u)
    return accepted, emitted
