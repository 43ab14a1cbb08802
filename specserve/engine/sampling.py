"""From target logits to the distribution a request samples from, and sampling it.

Pipeline (the order HF and vLLM use):

    logits -> apply_penalties (repetition, presence, frequency)
           -> apply_logit_bias (OpenAI's logit_bias: added last, "prior to sampling")
           -> probs_from_logits: temperature -> top-k -> top-p -> min-p -> softmax
           -> sample (or greedy argmax; temperature 0 gives a one-hot distribution)

Randomness. A request never owns a stateful generator. The uniform behind the token at
absolute position t (prompt included) is a counter-based hash of (seed, t, stream)
(SplitMix64, see `specserve.speculative.verify.position_uniforms`), and a token is drawn by
inverse CDF from that one uniform. Consequences:

- a request's tokens do not depend on which other requests share the batch, nor on the
  order of rows: each row brings its own (seed, position);
- they do not depend on speculation either: verifying a draft samples row i of
  [last, d1..dk] with the uniform of position t + i, exactly the one plain decoding would
  use there, so for drafts without probabilities (n-gram, suffix) "spec on == spec off"
  holds token for token at any temperature, not just in distribution;
- restarting or replaying a request (preemption, recomputation) reproduces it.

A request without a seed gets a fresh random one once, at admission (`resolve_seed`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from specserve.engine.logprobs import MAX_TOP_LOGPROBS
from specserve.speculative.verify import Stream, argmax_rows, position_uniforms, sample_from_probs

# below these, x / temperature overflows and top_p's mass comparison underflows
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6
# larger than any vocabulary, small enough for an int64 tensor
MAX_TOP_K = 1 << 31

__all__ = [
    "SamplingParams",
    "apply_logit_bias",
    "apply_penalties",
    "greedy",
    "probs_from_logits",
    "resolve_seed",
    "sample",
]


@dataclass
class SamplingParams:
    """How one request picks its tokens. Every default means "off"; temperature 0 is greedy.

    top_k: keep the k most likely tokens (0 = all). top_p: keep the smallest set of most
    likely tokens whose mass reaches top_p (1.0 = all). min_p: drop tokens less likely than
    min_p times the most likely one (0 = none). seed: None = a random seed per request.
    repetition_penalty: CTRL-style divisor for tokens seen in prompt or output (1 = off).
    presence_penalty / frequency_penalty: OpenAI-style subtractions for output tokens.
    stop_token_ids: generation ends after emitting one of these (the engine truncates).
    logit_bias: token id -> a value in [-100, 100] added to its logit (OpenAI's; -100 bans
    the token, +100 all but forces it).
    logprobs: None = off; n = each emitted token's log-probability and the n most likely
    tokens at its position (engine/logprobs.py; 0 = the token's own only).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 256
    stop_token_ids: Sequence[int] = ()  # stored as a tuple
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self._normalise()
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias)
        bias = self.logit_bias
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1] (1 = off), got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1] (0 = off), got {self.min_p}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2] (0 = off), got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2] (0 = off), got {self.frequency_penalty}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (all(t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)}"),
            (all(t >= 0 for t in bias),
             f"logit_bias keys must be token ids >= 0, got {list(bias)}"),
            (all(-100.0 <= b <= 100.0 for b in bias.values()),
             f"logit_bias values must be in [-100, 100], got {list(bias.values())}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def _normalise(self) -> None:
        """Values that are legal but would make the arithmetic fail become their limit (as
        vLLM does): a temperature too small to divide by is greedy, a top_p too small to
        compare with is the most likely token alone, a huge top_k is "all"."""
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if 0 < self.top_p < MIN_TOP_P:
            self.top_p = MIN_TOP_P
        self.top_k = min(self.top_k, MAX_TOP_K)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] with the request's logit_bias added to every row (a new tensor; the
    caller's rows may be the engine's reused buffer). The bias does not depend on the
    position, so verification rows [last, d1..dk] get what plain decoding gives each."""
    if not params.logit_bias:
        return logits
    ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
    bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    return logits.index_add(1, ids, bias.expand(logits.shape[0], -1))


def resolve_seed(seed: int | None) -> int:
    """The seed a request runs with: its own, or a fresh random 63-bit one (call once)."""
    return secrets.randbits(63) if seed is None else seed


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Repetition, presence and frequency penalties, row by row.

    logits: [N, V]; prompt_ids, output_ids: [N] token lists, the context row n is
    conditioned on. Verify rows [last, d1..dk] of one slot use output + d1..di for row i,
    so a penalised draft is judged exactly as plain decoding would judge it.
    Repetition (CTRL): tokens in prompt or output get logit / r if positive, * r if not.
    Presence / frequency (OpenAI): logit -= presence * [count > 0] + frequency * count,
    counting output tokens only. Returns [N, V] float32 (float64 if logits are float64).
    """
    rows = _per_row(params, logits.shape[0])
    x = logits.to(_float_dtype(logits))
    if not any(p.has_penalties for p in rows):
        return x
    if len(prompt_ids) != len(rows) or len(output_ids) != len(rows):
        raise ValueError(f"{len(rows)} rows need {len(rows)} prompt and output id lists")
    counts = _token_counts(output_ids, x.shape[-1], x)  # [N, V]
    seen = (counts > 0) | (_token_counts(prompt_ids, x.shape[-1], x) > 0)
    rep, presence, frequency = (
        torch.tensor([getattr(p, name) for p in rows], dtype=x.dtype, device=x.device)[:, None]
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
    )
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - presence * (counts > 0).to(x) - frequency * counts


def probs_from_logits(
    logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]
) -> torch.Tensor:
    """The distribution each row samples from, after temperature, top-k, top-p and min-p.

    logits: [N, V] (already penalised); params: one for all rows or one per row.
    Returns [N, V] float32 (float64 if logits are float64), rows summing to 1. Greedy rows
    (temperature 0) are one-hot on the first argmax, so every verification rule reduces to
    greedy verification on them. top-p is measured after top-k, as HF and vLLM do; min-p
    is relative to the most likely token, which no filter removes.
    """
    rows = _per_row(params, logits.shape[0])
    x = logits.to(_float_dtype(logits))
    temperature = [p.temperature if p.temperature > 0 else 1.0 for p in rows]
    x = x / torch.tensor(temperature, dtype=x.dtype, device=x.device)[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in rows):
        x = x.masked_fill(_top_k_top_p_mask(x, rows), -math.inf)
    if any(p.min_p > 0 for p in rows):
        min_p = torch.tensor([p.min_p for p in rows], dtype=x.dtype, device=x.device)
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); log(0) = -inf keeps all
        floor = x.max(dim=-1, keepdim=True).values + min_p.log()[:, None]
        x = x.masked_fill(x < floor, -math.inf)
    probs = torch.softmax(x, dim=-1)
    _argmax_where_no_mass(probs, logits)
    greedy_rows = [n for n, p in enumerate(rows) if p.greedy]
    if greedy_rows:
        g = torch.tensor(greedy_rows, dtype=torch.long, device=x.device)
        one_hot = torch.zeros_like(probs[g]).scatter_(-1, x[g].argmax(-1, keepdim=True), 1.0)
        probs[g] = one_hot
    return probs


def _argmax_where_no_mass(probs: torch.Tensor, logits: torch.Tensor) -> None:
    """Rows of probs [N, V] without a finite positive mass (NaN or inf logits, or a
    filter's overflow) become one-hot on the raw logits' argmax, NaN counted as -inf: a
    sampler fed NaN would draw an id past the vocabulary."""
    bad = ~(torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0))
    if bool(bad.any()):
        raw = torch.nan_to_num(logits[bad].to(probs.dtype), nan=-math.inf)
        probs[bad] = torch.zeros_like(raw).scatter_(-1, raw.argmax(-1, keepdim=True), 1.0)


def greedy(logits: torch.Tensor) -> list[int]:
    """logits: [N, V] -> the first argmax of each row (speculative/verify.py argmax_rows)."""
    return argmax_rows(logits)


def sample(probs: torch.Tensor, seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """Draw one token per row with the position-keyed randomness.

    probs: [N, V]; seeds, positions: [N] the row's request seed and the absolute position
    of the token being drawn. Returns [N] int64. Same (probs row, seed, position), same
    token, whatever the rest of the batch.
    """
    u = position_uniforms(seeds, positions, Stream.SAMPLE, probs.device)
    return sample_from_probs(probs, u)


def _top_k_top_p_mask(x: torch.Tensor, rows: Sequence[SamplingParams]) -> torch.Tensor:
    """x: [N, V] scaled logits -> [N, V] bool, True where top-k or top-p drops a token."""
    n, v = x.shape
    top_k = torch.tensor([min(p.top_k, v) if p.top_k > 0 else v for p in rows], device=x.device)
    top_p = torch.tensor([p.top_p for p in rows], dtype=x.dtype, device=x.device)
    # stable, so ties at the boundary are broken by token id, the same way every time
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    drop = torch.arange(v, device=x.device)[None, :] >= top_k[:, None]  # [N, V] by rank
    p_sorted = torch.softmax(sorted_x.masked_fill(drop, -math.inf), dim=-1)
    mass_before = p_sorted.cumsum(dim=-1) - p_sorted
    # the most likely token has mass_before 0 < top_p, so at least one token always stays
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    return torch.zeros_like(drop).scatter(-1, order, drop)


def _token_counts(ids: Sequence[Sequence[int]], vocab: int, like: torch.Tensor) -> torch.Tensor:
    """[N] token lists -> [N, V] occurrence counts, dtype and device of `like`."""
    counts = torch.zeros(len(ids), vocab, dtype=like.dtype, device=like.device)
    row = torch.tensor([n for n, seq in enumerate(ids) for _ in seq], dtype=torch.long)
    col = torch.tensor([t for seq in ids for t in seq], dtype=torch.long)
    ones = torch.ones(len(col), dtype=like.dtype, device=like.device)
    return counts.index_put_((row.to(like.device), col.to(like.device)), ones, accumulate=True)


def _per_row(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} rows")
    return list(params)


def _float_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32
