"""Engine: the one loop. Schedule, draft, one target forward, verify, commit, feed back, emit.

Isolation: an exception while drafting costs the step its drafts (drafts never change the
output); one while sampling, verifying or constraining a request fails that request alone.
Only a failed forward touches its whole batch: each of its requests is recomputed once
from its prompt, and fails if it is in a failed forward again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch

from specserve.engine.branch_drafts import branchable, branches, deciding_rows, kept_row
from specserve.engine.grammar_drafts import grammar_draft, kept_of
from specserve.engine.logprobs import TokenLogprob, token_logprobs
from specserve.engine.prompt_cache import PromptCache
from specserve.engine.request import Request, Status
from specserve.engine.runner import DEFAULT_SNAPSHOT_DEPTH, ModelRunner
from specserve.engine.samples import Samples, Start
from specserve.engine.sampling import (
    apply_logit_bias,
    apply_penalties,
    probs_from_logits,
    resolve_seed,
)
from specserve.engine.scheduler import Scheduler, StepPlan
from specserve.engine.threads import ThreadTuner
from specserve.engine.timed_forward import TimedForward
from specserve.errors import SpecserveError
from specserve.speculative.base import Draft, DraftRequest, Speculator
from specserve.speculative.cost import ForwardCost
from specserve.speculative.draft_length import DraftBudget
from specserve.speculative.verify import VerifyResult, verify

log = logging.getLogger("specserve.engine")
T = TypeVar("T")


def checked(result: VerifyResult, vocab: int) -> VerifyResult:
    """A sampler that drew an id outside the vocabulary is a bug to fail on here, in its
    own request, not in the next forward that every slot shares."""
    if not all(0 <= t < vocab for t in result.tokens):
        raise ValueError(f"sampled token ids {result.tokens} outside the vocabulary ({vocab})")
    return result


@dataclass
class StepOutput:
    """Tokens one request gained in a step, and whether it finished."""

    request: Request
    tokens: list[int]
    finished: bool
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, if asked
    error: Exception | None = None  # the request failed (finished, with no tokens)
    # how many of `tokens`, from the first, are accepted draft tokens, and the type of the
    # speculator that proposed them (what clients are shown of speculation at work)
    drafted: int = 0
    drafted_by: str = ""


class Proposal(NamedTuple):
    """A decoding slot's draft this step: the speculator's own, and what is verified of it
    (the same object unless a grammar cut or replaced it)."""

    own: Draft
    verified: Draft


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        speculator: Speculator | None = None,
        prefill_chunk: int = 512,
        cost: ForwardCost | None = None,
        threads: ThreadTuner | None = None,
        prompt_cache: bool = True,
    ) -> None:
        self.runner = runner
        # a step's logits go into one reused buffer sized for every slot verifying a draft
        # of the default length, or one row a slot without a speculator (runner.reuse_logits
        # says why; it grows if a step needs more)
        rows_per_slot = DEFAULT_SNAPSHOT_DEPTH if speculator is not None else 1
        runner.reuse_logits(runner.memory.num_slots * rows_per_slot)
        self.speculator = speculator
        # forward time by row count, so drafts are cut to what verifying them is worth here;
        # unmeasured by default (deterministic draft lengths, for tests)
        self.cost = cost if cost is not None else ForwardCost(measure=False)
        # thread count per forward by measured speed (None: leave torch's setting alone)
        self.threads = threads
        self.forward = TimedForward(runner, self.cost, threads)
        self.budget = DraftBudget(self.cost)  # each slot's draft limits per drafter, with the cost
        self.prompts = PromptCache(runner.memory, enabled=prompt_cache)
        self.scheduler = Scheduler(runner.memory.num_slots, prefill_chunk, self.prompts)
        self.samples = Samples(runner, self.scheduler)  # OpenAI's n: one prefill, n samples
        # alternatives to draft tokens verified, and kept (engine/branch_drafts.py)
        self.branches_verified = 0
        self.branches_kept = 0
        self._recurrent = runner.memory.recurrent is not None

    @property
    def max_len(self) -> int:
        """Tokens one slot holds: a request's prompt and output together."""
        return self.runner.memory.max_len

    @property
    def num_slots(self) -> int:
        return self.runner.memory.num_slots

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def add_request(self, req: Request) -> Request:
        self._check_request(req)
        self.scheduler.add(req)
        return req

    def add_samples(self, requests: list[Request]) -> list[Request]:
        """Samples of one prompt (OpenAI's n) that share its prefill: the first prefills it,
        the others copy its memory (engine/samples.py). All are checked before any queues."""
        first, *others = requests
        if any(r.prompt != first.prompt for r in others):
            raise SpecserveError("the samples of one request must share its prompt")
        for req in requests:
            self._check_request(req)
        self.scheduler.add(first)
        self.samples.add(first, others)
        return requests

    def _check_request(self, req: Request) -> None:
        max_len = self.runner.memory.max_len
        if not req.prompt:
            raise SpecserveError("the prompt is empty")
        if len(req.prompt) >= max_len:
            raise SpecserveError(
                f"the prompt has {len(req.prompt)} tokens; the context holds {max_len} "
                "(raise --ctx-size or shorten the prompt)"
            )
        vocab = self.runner.vocab_size
        beyond = [t for t in req.params.logit_bias if t >= vocab]
        if beyond:
            raise SpecserveError(f"logit_bias token ids must be < {vocab}, got {beyond[:5]}")
        req.seed = resolve_seed(req.params.seed)
        req.timings.prompt_n = len(req.prompt)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.samples.late)

    def step(self) -> list[StepOutput]:
        """Schedule, draft, one forward, verify, commit, feed back and emit."""
        out, plan = self._schedule()
        if not plan:
            return out
        proposals = self._draft(plan)
        try:
            pre_logits, logits = self.forward(plan, [p.verified for p in proposals])
        except Exception as e:
            return out + self._recompute_or_fail(plan.requests, e)
        out += self._after_prefills(plan, pre_logits)
        results = self._verify(plan.decode, proposals, logits)
        self._commit(plan.decode, proposals, results)
        return out + self._feed_back(plan.decode, proposals, results, logits)

    def _schedule(self) -> tuple[list[StepOutput], StepPlan]:
        """The step's plan, after siblings waiting for a slot (OpenAI's n) took the ones
        free: their first tokens come from their prompt's last row, with no forward."""
        out = self._start_samples(self.samples.place_late())
        return out, self.scheduler.schedule()

    def _after_prefills(self, plan: StepPlan, logits: list[torch.Tensor]) -> list[StepOutput]:
        outs: list[StepOutput | None] = []
        for (r, c, last), lg in zip(plan.prefill, logits, strict=True):
            if last:  # before r samples: a first token that ends r frees its slot
                outs += self._start_samples(self.samples.prefilled(r, lg))
            outs.append(self._isolated(r, self._after_prefill, r, c, lg))
        return [o for o in outs if o is not None]

    def _start_samples(self, starts: list[Start]) -> list[StepOutput]:
        """Siblings just given a slot: the prompt's memory copied in, then each one's first
        token from the prompt's last row, as after its own prefill."""
        outs = [self._isolated(s.request, self._start_sample, s) for s in starts]
        return [o for o in outs if o is not None]

    def _start_sample(self, start: Start) -> StepOutput | None:
        self.samples.copy_prompt(start)
        return self._after_prefill(start.request, [], start.logits)

    def _verify(
        self, decoding: list[Request], proposals: list[Proposal], logits: list[torch.Tensor]
    ) -> list[VerifyResult | StepOutput]:
        """Each slot's verified tokens, or its failure (StepOutput) when that was its own."""
        return [
            self._isolated(req, self._sample, req, lg, p.verified)
            for req, p, lg in zip(decoding, proposals, logits, strict=True)
        ]

    def _commit(
        self,
        decoding: list[Request],
        proposals: list[Proposal],
        results: list[VerifyResult | StepOutput],
    ) -> None:
        """Keep each slot's last token and its accepted drafts, an alternative's row moved
        into place where one was kept; the new token is fed next."""
        keeps, moved = {}, {}
        for req, p, v in zip(decoding, proposals, results, strict=True):
            if isinstance(v, VerifyResult):
                keeps[req.slot] = len(req.context) + v.accepted
                if (row := kept_row(req, p.verified, v)) is not None:
                    moved[req.slot] = row
        self.runner.commit(keeps, moved)

    def _feed_back(
        self,
        decoding: list[Request],
        proposals: list[Proposal],
        results: list[VerifyResult | StepOutput],
        logits: list[torch.Tensor],
    ) -> list[StepOutput]:
        return [
            v if isinstance(v, StepOutput) else self._isolated(req, self._accept, req, p, v, lg)
            for req, p, v, lg in zip(decoding, proposals, results, logits, strict=True)
        ]

    def _accept(
        self, req: Request, proposal: Proposal, result: VerifyResult, rows: torch.Tensor
    ) -> StepOutput:
        """Feed the verification back (speculator, draft budget, statistics), then emit
        (rows: the slot's raw logits, row i the one that decided result.tokens[i]). The
        speculator hears how much of its own draft was kept, which differs from what was
        verified only where a grammar cut or replaced it."""
        draft, verified = proposal
        if result.branch is not None:  # the draft kept up to the alternative
            own = result.accepted - 1
        else:
            own = result.accepted if verified is draft else kept_of(draft, result)
        if self.speculator is not None:
            self.speculator.accept(req.slot, own)
        self.budget.update(req.slot, len(draft), own, req.spec.n_max, draft.source)
        req.timings.draft_n += len(verified)
        req.timings.draft_n_accepted += result.accepted
        if (order := deciding_rows(verified, result)) is not None:
            rows = rows[order]
            self.branches_kept += 1
        out = self._emit(req, result.tokens, rows)
        out.drafted = min(result.accepted, len(out.tokens))  # a stop may cut the draft short
        out.drafted_by = verified.source if out.drafted else ""
        return out

    def _draft(self, plan: StepPlan) -> list[Proposal]:
        """One proposal per decoding slot: the speculator's draft (empty where it has none
        or speculation is off; the policy limits each slot's ask, speculative/draft_length.py)
        and what the slot verifies of it under its grammar (engine/grammar_drafts.py)."""
        drafts = self._speculate(plan)
        max_len = self.runner.memory.max_len
        out = []
        for r, d in zip(plan.decode, drafts, strict=True):
            room = min(r.spec.n_max, max_len - len(r.context))
            verified = grammar_draft(r, d, room)
            verified = branchable(r, verified, max_len - len(r.context), self._recurrent)
            self.branches_verified += len(verified.alternatives)
            out.append(Proposal(d, verified))
        return out

    def _speculate(self, plan: StepPlan) -> list[Draft]:
        wanted = [r for r in plan.decode if r.spec.n_max > 0]
        if self.speculator is None or not wanted:
            return [Draft() for _ in plan.decode]
        asks = self.budget.limit([self._draft_request(r) for r in wanted], plan.rows)
        if self.threads:  # a draft forward has a row per slot, as a plain step does
            self.threads.settle(len(asks))
        try:
            made = iter(self.speculator.draft(asks))
        except Exception:
            log.exception("drafting failed: this step verifies no drafts")
            return [Draft() for _ in plan.decode]
        return [next(made) if r.spec.n_max > 0 else Draft() for r in plan.decode]

    def _draft_request(self, req: Request) -> DraftRequest:
        """What the speculator is asked for this request, up to its n_max and to the room
        its slot has left: verification feeds [last, d1..dk] from len(context) - 1."""
        room = self.runner.memory.max_len - len(req.context)
        return DraftRequest(
            req.slot,
            req.context,
            min(req.spec.n_max, room),
            n_min=req.spec.n_min,
            p_min=req.spec.p_min,
            types=req.spec.types,
            prediction=req.prediction,
            temperature=0.0 if req.params.greedy else req.params.temperature,
            seed=req.seed,
            alternatives=req.spec.alternatives if branches(req, self._recurrent) else 0,
        )

    def _after_prefill(
        self, req: Request, chunk: list[int], logits: torch.Tensor
    ) -> StepOutput | None:
        """logits: [1, V] after the prompt's last chunk, [0, V] after an earlier one."""
        req.n_prefilled += len(chunk)
        if req.n_prefilled < len(req.prefill_ids):
            return None
        req.status = Status.DECODE
        if self.speculator is not None:
            self.speculator.begin(req.slot, req.prefill_ids, req.cache_salt)
        if req.output:  # a recomputed request: its newest token is fed next step
            return None
        req.timings.t_first = time.perf_counter()
        return self._emit(req, self._sample(req, logits, Draft()).tokens, logits)

    def _emit(self, req: Request, tokens: list[int], rows: torch.Tensor) -> StepOutput:
        """Append verified tokens up to the first stop; finish the request if it stopped.
        rows: raw logits, row i the one that decided tokens[i] (for logprobs)."""
        kept: list[int] = []
        reason = None
        for tok in tokens:
            kept.append(tok)
            req.output.append(tok)
            if tok in req.stop_ids or tok in req.params.stop_token_ids:
                reason = "stop"
            elif len(req.output) >= req.params.max_tokens:
                reason = "length"
            elif len(req.context) >= self.runner.memory.max_len:
                reason = "length"  # the context is full
            if reason:
                break
        req.timings.predicted_n = len(req.output)
        if req.constraint is not None:
            req.constraint.feed(kept)
        logprobs = []
        if req.params.logprobs is not None:
            logprobs = token_logprobs(rows, kept, req.params.logprobs)
            req.logprobs += logprobs
        if reason:
            self._finish(req, reason)
        return StepOutput(req, kept, reason is not None, logprobs)

    def _sample(self, req: Request, logits: torch.Tensor, draft: Draft) -> VerifyResult:
        """logits: [k + 1, V] for [last, d1..dk] -> the verified tokens of this request."""
        k = len(draft)
        if req.params.has_penalties:
            outputs = [req.output + list(draft.tokens[:i]) for i in range(k + 1)]
            logits = apply_penalties(logits, req.params, [req.prompt] * (k + 1), outputs)
        logits = apply_logit_bias(logits, req.params)
        probs = None if req.params.greedy else probs_from_logits(logits, req.params)
        result = verify(
            logits,
            draft,
            probs=probs,
            seed=req.seed,
            position=len(req.context),
            constraint=req.constraint,
        )
        return checked(result, logits.shape[-1])

    def _isolated(self, req: Request, fn: Callable[..., T], *args: Any) -> T | StepOutput:
        """fn(*args), or, if it raises, the request failed alone (its slot freed)."""
        try:
            return fn(*args)
        except Exception as e:
            return self._fail(req, e)

    def _fail(self, req: Request, error: Exception) -> StepOutput:
        log.error("request %d failed: %s: %s", req.id, type(error).__name__, error, exc_info=error)
        if not req.finished:
            self._finish(req, "error")
        return StepOutput(req, [], True, error=error)

    def _recompute_or_fail(self, batch: list[Request], error: Exception) -> list[StepOutput]:
        """A forward failed: no slot of its batch can be trusted. Each request goes back to
        the queue to be recomputed from its tokens (the same tokens follow: randomness is
        keyed by position), alone in its first forward, so a request that breaks forwards
        fails on its own; one that was recomputed already fails now."""
        log.error("a forward of %d requests failed", len(batch), exc_info=error)
        failed = []
        for req in batch:
            if req.recomputed:
                failed.append(self._fail(req, error))
                continue
            self.runner.free(req.slot)
            self.prompts.keep(req.slot, [])
            self.budget.reset(req.slot)
            if self.speculator is not None:
                self.speculator.reset(req.slot)
            self.scheduler.recompute(req)
        return failed

    def generate(self, requests: list[Request]) -> list[Request]:
        """Run requests to completion (offline use: CLI, tests, benchmarks)."""
        for req in requests:
            self.add_request(req)
        while self.has_work():
            self.step()
        return requests

    def abort(self, req: Request) -> None:
        """Stop a request (client gone): a running one frees its slot now, a waiting one
        leaves the queue. Call it from the thread that steps the engine, between steps."""
        if req.finished:
            return
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        elif not self.samples.drop(req):  # a sibling waiting for its prompt is not queued
            self._finish(req, "abort")
            return
        req.status, req.finish_reason = Status.FINISHED, "abort"
        self.samples.release(req)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.timings.t_end = time.perf_counter()
        self.samples.release(req)  # it ended before its prefill: a sibling takes it over
        self.scheduler.finish(req)
        self.runner.retire(req.slot)
        # a failed request's slot may hold half-written state: nothing of it is reused
        self.prompts.keep(req.slot, [] if reason == "error" else req.context, req.cache_salt)
        self.budget.reset(req.slot)
        if self.speculator is not None:
            self.speculator.reset(req.slot)
