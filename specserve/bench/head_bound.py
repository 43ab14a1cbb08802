"""`bench head-bound`: the most a model's EAGLE-3 head can give on the bench's answers, on
this machine, now.

    specserve bench head-bound --models qwen2.5-coder-0.5b --repeats 20

A head's speedup is set by two things `bench spec` cannot separate: how often the target
keeps its drafts, and what a verify row and a head step cost against a plain step (on a
Zen 4 VM a second row's cost moves with the VM's spells: docs/perf/2026-11-30-head-bound.md).
This measures both in one run:

- each workload's greedy answer (as `bench spec` makes it), scored teacher-forced: at every
  row, which of the head's next `--steps` greedy drafts the target keeps, and the head's
  probability for each (the drafts that a server's head makes there);
- the target's forwards of 1 to steps + 2 rows from the answer's context and one head step
  right after a target forward, in interleaved rounds (the medians, as ratios to one row).

From those, decoding the answer in plain steps' time (tokens per step over its cost):
- `policy`: the best of simple policies: ask the head every step, verify its draft where
  the first token's probability reaches theta, go on while each next one reaches p_min,
  at most k tokens. The thresholds are picked with hindsight on the answer itself.
- `oracle`: a drafter that knows which tokens the target keeps and drafts exactly those
  (no head step where none is): no policy with this head reaches it.
- `branch`: the best simple policy again, now with the head's second likeliest first token
  verified beside its first (one more row, a tree of depth one, as EAGLE's draft trees
  start) where the first token's probability is under phi; where the first is missed and
  the second kept, the step gains two tokens. Not bounded by `oracle`, which drafts one
  chain; `2nd` is the share of the first tokens missed whose second choice was right.
All three leave out what a step pays outside the forwards (lookups, sampling, the commit: small
beside a forward), and the chain's lookup drafts, which add little on new text.
A `bench spec` figure far under `policy` says the engine's policy leaves speed behind; a
target over `oracle` cannot be met with this head on this machine in this spell.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from specserve.batch import FlatBatch
from specserve.bench.args import numbers, positive
from specserve.bench.report import Column, format_table, interleaved
from specserve.bench.spec_workloads import UNTUNED
from specserve.engine.runner import ModelRunner, SlotInput
from specserve.errors import SpecserveError
from specserve.models.eagle3 import Eagle3Head
from specserve.models.registry import LanguageModel
from specserve.speculative import head_training as ht

WORKLOADS = ("quicksort-python", "quicksort-c", "quicksort-java", "prose")
THETAS = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
PHIS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)  # 0.0 first: never branch; 1.01: beside every first token
P_MINS = (0.0, 0.2, 0.4, 0.6)


@dataclass
class Scored:
    """One answer's rows, teacher-forced: kept[i, j] whether draft j at row i is the
    target's token (every earlier one being right, the draft is the one a server makes),
    p[i, j] the head's probability for it. Row i is the step after answer token i, whose
    draft proposes tokens i + 1 on."""

    kept: torch.Tensor
    p: torch.Tensor
    # [n]: whether the head's second likeliest first token is the target's (None: not scored)
    second: torch.Tensor | None = None


@dataclass
class Costs:
    """rows[n]: a forward of n rows over one of one row; head: one head step over it."""

    rows: dict[int, float]
    head: float
    one_row_ms: float


def scored(
    head: Eagle3Head, target: LanguageModel, prompt: list[int], answer: list[int], steps: int
) -> Scored:
    """The head's `steps` drafts at every step of the answer after its first token (which
    the prompt pass makes)."""
    rows = ht.target_rows(target, prompt + answer, head.cfg.aux_layers)
    # row start: the head fed the prompt's last state and answer token 0 drafts token 1 on
    start, n = len(prompt) - 1, len(answer) - 1
    kept = torch.zeros(n, steps, dtype=torch.bool)
    p = torch.zeros(n, steps)
    second = torch.zeros(n, dtype=torch.bool)
    with torch.no_grad():
        for j, (logits, labels) in enumerate(ht.unrolled_logits(head, target.embed, rows, steps)):
            probs, best = torch.softmax(logits.float(), dim=-1).topk(2, dim=-1)
            m = max(0, min(n, logits.shape[0] - start))
            right = head.d2t[best] == labels[:, None]
            kept[:m, j] = right[start : start + m, 0]
            p[:m, j] = probs[start : start + m, 0]
            if j == 0:
                second[:m] = right[start : start + m, 1]
    return Scored(kept, p, second)


def policy_value(
    s: Scored, c: Costs, theta: float, p_min: float, k: int, phi: float = 0.0
) -> float:
    """Tokens per plain step's time with the head asked every step (module doc); phi: the
    second likeliest first token is verified too where the first's probability is under it
    (`branch`)."""
    n, tokens, spent, i = s.kept.shape[0], 0, 0.0, 0
    second = s.second if s.second is not None and phi > 0 else None
    while i < n:
        drafted, asked = 0, 0
        for j in range(min(k, n - 1 - i)):
            asked += 1
            if s.p[i, j] < (theta if j == 0 else p_min):
                break
            drafted += 1
        kept = _run_length(s.kept[i, :drafted])
        branch = False
        # given costs may stop at steps + 1 rows: a full draft then goes without its sibling
        if second is not None and drafted > 0 and drafted + 2 in c.rows and s.p[i, 0] < phi:
            branch = True
            if kept == 0 and bool(second[i]):
                kept = 1  # the sibling row was the target's token
        rows = drafted + 1 + int(branch)
        tokens, spent = tokens + 1 + kept, spent + c.rows[rows] + asked * c.head
        i += 1 + kept
    return tokens / spent if spent else 1.0


def oracle_value(s: Scored, c: Costs) -> float:
    """Tokens per plain step's time drafting exactly the tokens the target keeps."""
    n, tokens, spent, i = s.kept.shape[0], 0, 0.0, 0
    while i < n:
        kept = _run_length(s.kept[i, : n - 1 - i])
        tokens += 1 + kept
        spent += c.rows[kept + 1] + kept * c.head if kept else 1.0
        i += 1 + kept
    return tokens / spent if spent else 1.0


def best_policies(
    s: Scored, c: Costs, phis: tuple[float, ...] = (0.0,)
) -> dict[float, tuple[float, float, float, int, float]]:
    """Each phi of `phis` (0: never branch) -> (value, theta, p_min, k, phi) of the best
    policy branching at it, in one pass; (1.0, inf, 0, 0, phi): never ask."""
    best = {phi: (1.0, float("inf"), 0.0, 0, phi) for phi in phis}
    steps = s.kept.shape[1]
    for theta, p_min, k, phi in itertools.product(THETAS, P_MINS, range(1, steps + 1), phis):
        value = policy_value(s, c, theta, p_min, k, phi)
        if value > best[phi][0]:
            best[phi] = (value, theta, p_min, k, phi)
    return best


def best_policy(
    s: Scored, c: Costs, phis: tuple[float, ...] = (0.0,)
) -> tuple[float, float, float, int, float]:
    """(value, theta, p_min, k, phi) of the best policy, branching at phi, one of `phis`
    (0: never; the earlier phi on a tie); (1.0, inf, 0, 0, 0): never ask."""
    return _top(best_policies(s, c, phis))


def _top(
    found: dict[float, tuple[float, float, float, int, float]],
) -> tuple[float, float, float, int, float]:
    """The best of `best_policies`' (the earlier phi on a tie), phi 0 where none asks."""
    top = max(found.values(), key=lambda b: b[0])
    return top if top[3] else (1.0, float("inf"), 0.0, 0, 0.0)


def _run_length(kept: torch.Tensor) -> int:
    """How many leading entries are True."""
    return int(kept.long().cumprod(0).sum())


@torch.inference_mode()
def time_costs(
    runner: ModelRunner, head: Eagle3Head, context: list[int], steps: int, rounds: int
) -> Costs:
    """The target's forwards of 1..steps + 2 rows after `context` (a full draft, and its
    first token's sibling), and a head step after each (its weights as cold as a served
    step leaves them), in interleaved rounds."""
    mem, counts = runner.memory, list(range(1, steps + 3))
    runner.reuse_logits(max(counts))
    runner.prefill(0, context[:-1])
    base, last = mem.length(0), context[-1]
    cache = head.new_cache(1, base + 8)
    h = head.cfg.hidden_size
    embed = runner.model.embed
    head(embed(torch.tensor(context[:8])), torch.zeros(8, h), _batch(0, 8), cache)
    forwards: dict[int, list[float]] = {m: [] for m in counts}
    head_steps: list[float] = []
    for i, m in enumerate(interleaved(counts, rounds + 1)):
        mem.commit(0, base)
        t0 = time.perf_counter()
        runner.forward([SlotInput(0, [last] * m, m)])
        t1 = time.perf_counter()
        cache.truncate(0, 8)
        normed, _ = head.forward_last(
            embed(torch.tensor([last])), torch.zeros(1, h), _batch(8, 1), cache
        )
        torch.softmax(head.lm_head(normed).float(), dim=-1).max(dim=-1)
        t2 = time.perf_counter()
        if i >= len(counts):  # the first round only warms up
            forwards[m].append(t1 - t0)
            head_steps.append(t2 - t1)
    one = statistics.median(forwards[1])
    rows = {m: statistics.median(v) / one for m, v in forwards.items()}
    return Costs(rows, statistics.median(head_steps) / one, one * 1e3)


def given_costs(spec: str, steps: int) -> Costs:
    """--costs "1.27,1.46,1.66,1.85,0.10" -> Costs (one_row_ms 0: not timed)."""
    values = numbers(spec, float)
    if len(values) != steps + 1 or min(values, default=0) <= 0:
        raise SpecserveError(
            f"--costs: {steps + 1} positive numbers (forwards of 2..{steps + 1} rows over one "
            f"row, then a head step over one row), got {spec!r}"
        )
    rows = {1: 1.0, **{m + 2: v for m, v in enumerate(values[:-1])}}
    return Costs(rows, values[-1], 0.0)


def _batch(start: int, n: int) -> FlatBatch:
    """Slot 0's rows start .. start + n - 1 of the head's cache."""
    return FlatBatch.build([0], [start], [n], torch.device("cpu"))


COLUMNS = [
    Column("workload", "workload"),
    Column("tokens", "tokens"),
    Column("kept", "kept at 1 / 2 / 3 / 4"),
    Column("policy", "policy", ".2f"),
    Column("args", "theta, p_min, k"),
    Column("oracle", "oracle", ".2f"),
    Column("second", "2nd"),
    Column("branch", "branch", ".2f"),
    Column("phi", "phi"),
]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b"], help="names or paths")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS + UNTUNED,
        default=list(WORKLOADS),
        metavar="WORKLOAD",
        help=f"default: {' '.join(WORKLOADS)}; also: {' '.join(UNTUNED)} (`bench spec`'s)",
    )
    p.add_argument(
        "--head", default=None, help="the head (a path or a cache name; default: the model's own)"
    )
    p.add_argument(
        "--draft-weights",
        default="int4",
        choices=["dequant", "int8", "int4"],
        help="the head's weights (int4: as `bench spec` and a server load it by default)",
    )
    p.add_argument("--steps", type=positive, default=4, help="draft tokens scored per row")
    p.add_argument("--max-tokens", type=positive, default=256, help="answer length")
    p.add_argument(
        "--repeats", type=positive, default=20, help="interleaved rounds of the timed forwards"
    )
    p.add_argument(
        "--costs",
        default=None,
        metavar="R2,...,HEAD",
        help="costs given instead of timed: a forward of 2, 3, ... steps + 1 rows over one of "
        "one row, then a head step over it (e.g. 1.27,1.46,1.66,1.85,0.10: what a fast spell "
        "of a Zen 4 VM measured), to see what the head would give where rows cost that, "
        "or to compare heads on the same figures (`branch` then prices no sibling beside a "
        "full draft)",
    )


def main(args: argparse.Namespace) -> None:
    from specserve.bench.head_data import answers
    from specserve.bench.spec_workloads import messages
    from specserve.loading.eagle3 import load_eagle3, own_head_name
    from specserve.loading.model import load_model

    given = given_costs(args.costs, args.steps) if args.costs else None  # before any load
    for name in args.models:
        loaded = load_model(name, "float32", progress=True, weights="auto")
        head = load_eagle3(args.head or own_head_name(name), loaded.cfg, weights=args.draft_weights)
        tok = loaded.tokenizer
        if tok is None:
            raise SpecserveError(f"{name} has no tokenizer: the workloads need its chat template")
        prompts = [list(tok.chat(messages(w, None))) for w in args.workloads]
        replies = answers(loaded, prompts, args.max_tokens, len(prompts), tok.eog_ids)
        if given is not None:
            costs = given
        else:
            prompt, reply = replies[0]
            runner = ModelRunner(loaded.model, 1, len(prompt) + len(reply) + args.steps + 16)
            costs = time_costs(runner, head, prompt + reply, args.steps, args.repeats)
        rows = ", ".join(f"{m} rows {v:.2f}" for m, v in costs.rows.items() if m > 1)
        timed = f"a plain step's forward {costs.one_row_ms:.2f} ms" if costs.one_row_ms else "given"
        print(f"[{name}] {timed}; {rows}; a head step {costs.head:.3f} of a step")
        table = []
        for w, (prompt, reply) in zip(args.workloads, replies, strict=True):
            s = scored(head, loaded.model, prompt, reply, args.steps)
            found = best_policies(s, costs, PHIS)
            value, theta, p_min, k, _ = found[0.0]
            row = _row(w, s, value, (theta, p_min, k), oracle_value(s, costs))
            table.append(row | _branch_row(s, _top(found)))
        print(format_table(table, COLUMNS))


def _row(
    workload: str, s: Scored, value: float, args: tuple[float, float, int], oracle: float
) -> dict:
    """A table row; `kept` per position: the chance a draft reaching it is kept there."""
    reached = torch.ones(s.kept.shape[0], dtype=torch.bool)
    shares = []
    for j in range(min(4, s.kept.shape[1])):
        n = int(reached.sum())
        reached = reached & s.kept[:, j]
        shares.append(f"{int(reached.sum()) / n:.2f}" if n else "-")
    theta, p_min, k = args
    chosen = "never" if k == 0 else f"{theta:.1f}, {p_min:.1f}, {k}"
    tokens = s.kept.shape[0] + 1
    return {
        "workload": workload,
        "tokens": tokens,
        "kept": " / ".join(shares),
        "policy": value,
        "args": chosen,
        "oracle": oracle,
    }


def _branch_row(s: Scored, best: tuple[float, float, float, int, float]) -> dict:
    """The table's `2nd`, `branch` and `phi` (the module doc)."""
    missed = ~s.kept[:, 0]
    n = int(missed.sum())
    second = "-" if s.second is None or not n else f"{int(s.second[missed].sum()) / n:.2f}"
    value, *_, k, phi = best
    return {"second": second, "branch": value, "phi": "never" if k == 0 else f"{phi:.2f}"}
