"""`bench spec`'s rounds: every configuration in turn, or side by side (`--lockstep`).

Run one after the other, a round's configurations are 10-20 s apart on this project's
machine, and a VM's memory speed moves within that: a round's ratio of two configurations
spread 0.94-1.16 where the difference between them was about 1 %. Here every configuration
has its own engine over the same loaded weights, and the engines take one step each in
turn, the order reversed every other step, so each configuration's steps sit among every
other's within tens of milliseconds; each is timed by its own steps alone. The engines of
a round time their forwards into one `ForwardCost`: timed each by its own, two engines of
the same configuration priced rows apart, cut their drafts apart and took paths of their
own through the answer (docs/perf/2026-12-01-lockstep.md).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from specserve.bench.report import interleaved
from specserve.bench.spec_report import (
    NONE,
    SHARED,
    Run,
    drafters,
    fewer_threads,
    ledgers,
    members,
    progress_line,
)
from specserve.bench.spec_workloads import GRAMMARS
from specserve.engine.request import Request
from specserve.speculative.base import SpecStats
from specserve.speculative.cost import ForwardCost
from specserve.speculative.ledger import Mark

if TYPE_CHECKING:
    from specserve.engine.engine import Engine
    from specserve.grammar.formats import Grammar


# the tenant of the asks an engine answers before its timed request (`serve_first`): their
# text goes into that tenant's tables, which the timed request (the default tenant) never reads
SERVED = "bench-served"


@dataclass
class Started:
    """A configuration's engine with its request, not yet added; `marks`: its costly
    drafters' ledgers before the request (`serve_first`), so a run reports its own asks."""

    engine: Engine
    req: Request
    marks: dict[str, Mark] = field(default_factory=dict)
    ran: Counter[int] = field(init=False)  # the thread tuner's forwards before the request
    branched: tuple[int, int] = field(init=False)  # the alternatives before it (`branches`)

    def __post_init__(self) -> None:
        self.ran = Counter(self.engine.threads.ran if self.engine.threads else {})
        self.branched = self.branches()

    def branches(self) -> tuple[int, int]:
        """The engine's alternatives verified and kept so far (speculative/verify.py)."""
        return self.engine.branches_verified, self.engine.branches_kept

    def run(self, tok_s: float, seconds: float) -> Run:
        """What the request generated, at `tok_s`, in `seconds`."""
        drafting = self.engine.speculator
        stats = drafting.stats.as_dict() if drafting else None
        tokens = list(self.req.output)
        spent = ledgers(drafting, self.marks)
        tuner = self.engine.threads
        fewer = fewer_threads(Counter(tuner.ran) - self.ran, tuner.options[-1]) if tuner else ""
        (offered, kept), (before, kept_before) = self.branches(), self.branched
        branches = (offered - before, kept - kept_before)
        return Run(tokens, tok_s, seconds, stats, spent, drafters(drafting), fewer, branches)


def serve_first(started: Started, prompts: list[list[int]]) -> Started:
    """The engine answers `prompts` (greedy, as the timed request's settings) before its
    timed request, as a running server would have, under the SERVED tenant. What its
    drafters learnt there stays (rates, value, ledgers); their counters start again, so the
    run's statistics and asks are its own request's."""
    engine, req = started.engine, started.req
    first = [
        Request(p, req.params, req.spec, stop_ids=req.stop_ids, cache_salt=SERVED) for p in prompts
    ]
    engine.generate(first)
    drafting = engine.speculator
    for s in [drafting, *members(drafting)] if drafting else []:
        s.stats = SpecStats()
    marks = {c.name: c.worth.ledger.mark() for c in members(drafting)}
    return Started(engine, req, marks)


class RunSource(Protocol):
    """What the rounds need of a benchmark session (spec.py `Session`)."""

    def prompt(self, model: str, workload: str) -> list[int]: ...

    def prediction(self, model: str, workload: str) -> list[int]: ...

    def start(
        self,
        model: str,
        config: str,
        prompt: list[int],
        max_tokens: int | None = None,
        prediction: list[int] | None = None,
        grammar: Grammar | None = None,
        learned: list[int] | None = None,
        cost: ForwardCost | None = None,
    ) -> Started: ...

    def since_load(self) -> float: ...


@dataclass(frozen=True)
class Warm:
    """Untimed rounds before the timed ones: at least `rounds`, and more until `seconds`
    have passed since a model was last loaded."""

    rounds: int = 0
    seconds: float = 0.0


def rounds(
    session: RunSource,
    model: str,
    workload: str,
    configs: list[str],
    ref: Run,
    repeats: int,
    warm: Warm = Warm(),
    together: bool = False,
) -> dict[str, list[Run]]:
    """Each configuration's runs, in rounds of every configuration in turn, odd ones
    reversed, so slow spells on a shared machine hit all of them alike; ratios are taken
    within a round. `together`: a round's configurations run side by side instead
    (`lockstep`). Untimed rounds go first (`warm`), as the first runs after a load or a
    new prompt went at another pace than the rest (docs/perf/2026-11-30-warm-rounds.md):
    the reference run warms `none`, those rounds the others. Without them, the first
    round's `none` is the reference run (when not together)."""
    runs: dict[str, list[Run]] = {c: [] for c in configs}
    prompt = session.prompt(model, workload)
    kw: dict[str, Any] = {
        "prediction": session.prediction(model, workload),
        "grammar": GRAMMARS.get(workload),
    }

    def start(config: str, cost: ForwardCost | None = None) -> Started:
        learned = ref.tokens if config.startswith(SHARED) else None
        return session.start(model, config, prompt, learned=learned, cost=cost, **kw)

    def run(names: list[str], timed: bool) -> dict[str, Run]:
        shared = ForwardCost() if together else None  # one a round: see the module's doc
        out = lockstep({c: start(c, shared) for c in names}) if together else {}
        for c in names:
            if not together:  # each printed as it ends, not after the round
                out[c] = alone(start(c))
            print(progress_line(model, workload, c, out[c], timed), flush=True)
        return out

    speculating = [c for c in configs if c != NONE]
    warmed = 0
    while speculating and (warmed < warm.rounds or session.since_load() < warm.seconds):
        run(speculating if warmed % 2 == 0 else speculating[::-1], timed=False)
        warmed += 1
    if together:
        for _ in range(repeats):
            for config, out in run(configs, timed=True).items():
                runs[config].append(out)
        return runs
    for i, config in enumerate(interleaved(configs, repeats)):
        if i == 0 and config == NONE and not warmed:
            runs[config].append(ref)
            print(progress_line(model, workload, config, ref), flush=True)
        else:
            runs[config].append(run([config], timed=True)[config])
    return runs


def alone(started: Started) -> Run:
    """The request run to its end by its engine alone."""
    t0 = time.perf_counter()
    started.engine.generate([started.req])
    seconds = time.perf_counter() - t0
    return started.run(float(started.req.timings.as_dict()["predicted_per_second"]), seconds)


def lockstep(started: dict[str, Started]) -> dict[str, Run]:
    """Every request to its end, one engine step of each in turn. A run's tok/s counts,
    as a lone run's does (`Timings`), the tokens after its first over the steps after the
    one that gave it."""
    decode = dict.fromkeys(started, 0.0)
    total = dict.fromkeys(started, 0.0)
    for s in started.values():
        s.engine.add_request(s.req)
    live, turn = list(started), 0
    while live:
        # each turn starts one further along: with three or more, reversing every other
        # turn kept one engine in the middle, and that one ran faster
        # (docs/perf/2026-12-01-spare-order.md)
        shift = turn % len(live)
        for name in live[shift:] + live[:shift]:
            s = started[name]
            decoding = len(s.req.output) > 0
            t0 = time.perf_counter()
            s.engine.step()
            took = time.perf_counter() - t0
            total[name] += took
            decode[name] += took if decoding else 0.0
        live = [n for n in live if started[n].engine.has_work()]
        turn += 1
    return {n: s.run(_tok_s(s.req, decode[n]), total[n]) for n, s in started.items()}


def _tok_s(req: Request, seconds: float) -> float:
    n = len(req.output)
    return (n - 1) / seconds if n > 1 and seconds > 0 else 0.0
