"""Benchmark: speculative decoding on real prompts: speed, acceptance, and exactness.

    specserve bench spec --models qwen2.5-coder-0.5b qwen2.5-coder-1.5b --out bench-out

Workloads (chat template, greedy):
- quicksort-{c,java,python}: "Write a quicksort demo in C. Please, write just code. ..."
  Fresh code: n-gram drafters find little to copy.
- rewrite-{c,java,python}: turn 2 of that conversation, "Rewrite the same program with
  descriptive variable names.", after the model's OWN turn-1 answer (generated here without
  speculation, once per model). The answer is mostly a copy of the context, which is where
  drafting from the context pays.
- predicted-{c,java,python}: quicksort-*'s prompt, sent with OpenAI's `prediction`: the
  model's own answer with identifiers renamed (EDITS), as a client holding an earlier,
  edited answer would send it. Only configurations with the `prediction` drafter use it.
- prose: "Write a short story about a lighthouse keeper." Little to copy.
- {mergesort,stack,bfs}-{c,java,python}, prose-clockmaker: turn 1 asking for other programs
  and another story. Nothing was tuned on them: a head or rule chosen by how it served the
  four answers above should serve these as well. Run only when named.
- json: a table of sorting algorithms asked for in JSON mode (`response_format`
  json_object: constrained decoding, grammar/); keys repeat in every entry.
- json-schema: the same ask held to a JSON schema (SORTS): its keys, separators and enum
  values are forced tokens, which the `forced` configuration drafts and nothing else;
  json-free asks the same without a grammar, the unconstrained reference.

Every configuration (`--spec-types`) runs on every model and workload, plus `none`, which
is the reference: `speedup` is tok/s over the same model's `none` on the same workload, the
median over rounds of each round's own ratio (`--repeats`: a slow spell of the machine
slows both runs of a round), and `same` says whether the tokens equal `none`'s (the greedy
contract). `--versus CONFIG` adds the same paired ratio against another configuration (a
chain with a drafter over the chain without it). Configurations with
`draft` use `--draft-model` and are skipped for the draft model itself. Each run gets a
fresh engine, so cross-request memories (suffix's global tree, ngram-cache's dynamic
cache) start empty and one configuration cannot learn from an earlier one's output.
With --served-first, each speculating engine first answers other asks, as a running server
would have (spec_rounds.py `serve_first`): its drafters then start from the rates learnt
there, not from their priors, while its text tables hold nothing of the timed request's
tenant.

tok/s counts decoding only (the tokens after the first, over the time after the prompt
pass), so a draft model's own prompt pass, made at its first draft, counts against it.

The models load as a server loads them by default (--weights auto: each GGUF tensor on the
low-bit kernel of its own type); `--weights dequant` measures the float weights. The default
dtype is float32, as verifying drafts (many-row forwards) is slower in bfloat16 on CPUs
without bf16 instructions (docs/perf/bench.md); with --dtype bfloat16, watch `same`.

With --max-tokens below an answer's length, the rewrite workloads quote a truncated turn 1
(it is the same generation as the quicksort workload's reference).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve.bench.report import Column, format_table
from specserve.bench.spec_report import (
    COLUMNS,
    NONE,
    SHARED,
    Run,
    make_row,
    write_outputs,
)
from specserve.bench.spec_rounds import Started, Warm, alone, rounds, serve_first
from specserve.bench.spec_workloads import (
    GRAMMARS,
    UNTUNED,
    WORKLOADS,
    edited,
    messages,
    turn1_lang,
)
from specserve.errors import SpecserveError
from specserve.grammar.formats import Grammar
from specserve.models.layers.quant import WEIGHT_MODES

if TYPE_CHECKING:
    from specserve.loading.model import LoadedModel
    from specserve.loading.tokenizer import Tokenizer
    from specserve.speculative.cost import ForwardCost

CONFIGS = (
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
    "suffix",
    "ngram-map-k,suffix",
    "ngram-map-k,suffix,prediction",
    "draft",
    "ngram-map-k,suffix,draft",
)
# no speculator: only the tokens a grammar forces are drafted
FORCED = "forced"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models",
        nargs="+",
        default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"],
        help="target models (names or paths)",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        default=list(WORKLOADS),
        choices=WORKLOADS + UNTUNED,
        metavar="WORKLOAD",
        help=f"default: {' '.join(WORKLOADS)}; named only: {' '.join(UNTUNED)} (asks nothing "
        "was tuned on: see the module doc)",
    )
    p.add_argument(
        "--spec-types",
        nargs="+",
        default=list(CONFIGS),
        metavar="CONFIG",
        help="configurations: a speculator type or a comma-separated chain, or `forced` (no "
        "speculator: only the tokens a grammar forces are drafted), or `shared:CHAIN` (CHAIN "
        "told the reference's output first, as --share-outputs tells a replica what another "
        "answered), each with `@N` for N runners-up a head may offer for each draft token "
        "(--draft-alternatives; `@0`: none); `none` (no speculation) always runs first as "
        "the reference",
    )
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b", help="for `draft` configs")
    p.add_argument("--draft-max", type=int, default=16, help="most draft tokens per step")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate per run")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float64", "float32", "bfloat16"],
        help="float32 by default: fastest to verify drafts on AVX2 CPUs (see the docstring)",
    )
    p.add_argument(
        "--weights",
        default="auto",
        choices=WEIGHT_MODES,
        help="the models' --weights (auto, as a server loads them by default; dequant: float)",
    )
    p.add_argument(
        "--draft-weights",
        default="auto",
        choices=WEIGHT_MODES,
        help="the draft model's and head's --weights (auto: int4, as a server's default)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every configuration; the table shows median tok/s (a shared VM's "
        "run-to-run spread is +-10%%: use 3 where a target is within that)",
    )
    p.add_argument(
        "--warm-rounds",
        type=int,
        default=1,
        help="untimed rounds of every configuration before the timed ones, per workload: "
        "the first runs after a load or a new prompt go at another pace (0: none, and the "
        "reference run counts as the first round's `none`)",
    )
    p.add_argument(
        "--warm-seconds",
        type=float,
        default=60.0,
        help="and more of them until this long has passed since a model was last loaded: "
        "a VM decodes faster for a while after a load (docs/perf/bench.md)",
    )
    p.add_argument(
        "--versus",
        default=None,
        metavar="CONFIG",
        help="one of --spec-types: a `vs` column gives each configuration's tok/s over this "
        "one's in the same round (median over rounds), e.g. a chain with a head over without",
    )
    p.add_argument(
        "--head-minutes",
        type=float,
        default=120.0,
        help="a configuration with eagle3 for a model whose head is not in the cache trains "
        "one first (`specserve train-head`, this budget; a stopped run resumes); 0: refuse",
    )
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="run a round's configurations side by side, one engine step of each in turn "
        "(each timed by its own steps), not one after the other: the VM's drifting speed "
        "then moves a round's ratios far less",
    )
    p.add_argument(
        "--served-first",
        nargs="+",
        default=[],
        choices=WORKLOADS + UNTUNED,
        metavar="WORKLOAD",
        help="every speculating engine first answers these (untimed, as another tenant, so "
        "their text is never drafted from), as a running server would have: its drafters "
        "start from the rates, value and ledgers learnt there, not from nothing; not one of "
        "--workloads (e.g. mergesort-c stack-java bfs-python prose-clockmaker)",
    )
    p.add_argument("--out", type=Path, default=None, help="write spec.json and spec.png here")


class Session:
    """Models loaded once per benchmark run, and each model's reference (no-spec) runs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.loaded: dict[str, LoadedModel] = {}
        self.plain: dict[tuple[str, str], Run] = {}  # (model, workload) -> no-spec run
        self._loaded_at = time.monotonic()

    def load(self, name: str, draft: bool = False) -> LoadedModel:
        """A model as a target, or as a draft (on --draft-weights)."""
        from specserve.loading.model import load_model, parse_dtype
        from specserve.models.layers.quant import draft_mode

        a = self.args
        weights = draft_mode(a.draft_weights, parse_dtype(a.dtype), "cpu") if draft else a.weights
        key = name if weights == a.weights else f"{name} as a draft"
        if key not in self.loaded:
            self.loaded[key] = load_model(name, a.dtype, progress=True, weights=weights)
            self._loaded_at = time.monotonic()
            if key == name:
                self._warm_up(name)
        return self.loaded[key]

    def _warm_up(self, name: str) -> None:
        """One short generation, so the first timed run pays no one-time costs."""
        tok = self.tokenizer(name)
        alone(self.start(name, NONE, tok.chat([{"role": "user", "content": "Hi"}]), max_tokens=4))

    def since_load(self) -> float:
        """Seconds since a model was last loaded."""
        return time.monotonic() - self._loaded_at

    def prompt(self, model: str, workload: str) -> list[int]:
        """The workload's prompt ids; a rewrite quotes the model's own turn-1 answer."""
        return list(self.tokenizer(model).chat(messages(workload, self._turn1(model, workload))))

    def prediction(self, model: str, workload: str) -> list[int]:
        """What a predicted-* workload's requests send as `prediction` (else nothing)."""
        if not workload.startswith("predicted-"):
            return []
        return self.tokenizer(model).encode_text(edited(self._turn1(model, workload) or ""))

    def _turn1(self, model: str, workload: str) -> str | None:
        """The model's own answer to the turn 1 a rewrite or predicted workload builds on."""
        lang = turn1_lang(workload)
        if lang is None:
            return None
        return self.tokenizer(model).decode(self.reference(model, f"quicksort-{lang}").tokens)

    def tokenizer(self, model: str) -> Tokenizer:
        tok = self.load(model).tokenizer
        if tok is None:
            raise SpecserveError(f"{model} has no tokenizer: the workloads need its chat template")
        return tok

    def reference(self, model: str, workload: str) -> Run:
        key = (model, workload)
        if key not in self.plain:
            prompt = self.prompt(model, workload)
            self.plain[key] = alone(self.start(model, NONE, prompt, grammar=GRAMMARS.get(workload)))
        return self.plain[key]

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
    ) -> Started:
        """A greedy generation's fresh engine over the already loaded weights, and its
        request, not yet added; `learned`: an output its speculators take in first, as one
        shared by another replica; `cost`: row costs shared with other engines (lockstep).
        `alone` runs it to its end."""
        from specserve.engine.request import Request, SpecParams
        from specserve.engine.sampling import SamplingParams
        from specserve.engine.setup import EngineSettings, build_engine
        from specserve.grammar.constraint import build_constraint

        a = self.args
        n = max_tokens or a.max_tokens
        chain, _, alternatives = config.removeprefix(SHARED).partition("@")
        types = () if chain in (NONE, FORCED) else tuple(chain.split(","))
        first = self.served_first(model) if types else []
        settings = EngineSettings(
            model=model,
            dtype=a.dtype,
            weights=a.weights,
            draft_weights=a.draft_weights,
            # room for the longest prompt, the answer and one last verification
            ctx_size=max(map(len, [prompt, *first])) + n + a.draft_max + 8,
            spec_types=types,
            draft_model=a.draft_model if "draft" in types else None,
        )
        draft = self.load(a.draft_model, draft=True) if "draft" in types else None
        engine, _ = build_engine(settings, target=self.load(model), draft=draft, cost=cost)
        if learned and not (engine.speculator and engine.speculator.learn(learned)):
            raise SpecserveError(f"{config}: none of its speculators learns shared outputs")
        params = SamplingParams(temperature=0.0, max_tokens=n)
        spec = SpecParams(n_max=a.draft_max if types or config == FORCED else 0)
        if alternatives:
            spec.alternatives = int(alternatives)
        tok = self.tokenizer(model)
        req = Request(prompt, params, spec, stop_ids=tok.eog_ids)
        req.prediction = prediction or []
        if grammar is not None:
            req.constraint = build_constraint(tok, self.load(model).cfg.vocab_size, grammar)
        return serve_first(Started(engine, req), first) if first else Started(engine, req)

    def served_first(self, model: str) -> list[list[int]]:
        """The prompts of --served-first (a speculating engine answers them first)."""
        return [self.prompt(model, w) for w in self.args.served_first]


def configs_for(model: str, args: argparse.Namespace) -> list[str]:
    """`none` first, then the asked configurations that make sense for this model."""
    asked = [c for c in args.spec_types if c != NONE]
    # a model drafting for itself would accept everything and measure nothing
    return [
        NONE,
        *(c for c in asked if "draft" not in chain_of(c) or model != args.draft_model),
    ]


def chain_of(config: str) -> list[str]:
    """A configuration's speculator types (`shared:` and `@N` left off)."""
    return config.removeprefix(SHARED).partition("@")[0].split(",")


def main(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.versus is not None and args.versus not in (NONE, *args.spec_types):
        raise SpecserveError(f"--versus {args.versus}: not one of --spec-types")
    if both := sorted(set(args.served_first) & set(args.workloads)):
        # learnt on the answer it is then timed on, a drafter's rates would be that answer's
        raise SpecserveError(f"--served-first {' '.join(both)}: also benchmarked (--workloads)")
    own_heads(args)
    session = Session(args)
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for workload in args.workloads:
            ref = session.reference(model, workload)
            configs = configs_for(model, args)
            warm = Warm(args.warm_rounds, args.warm_seconds)
            runs = rounds(session, model, workload, configs, ref, args.repeats, warm, args.lockstep)
            if workload in GRAMMARS:
                print(compile_line(session, model, GRAMMARS[workload]), flush=True)
            base = runs.get(args.versus) if args.versus else None
            for config in configs:
                rows.append(make_row(model, workload, config, runs[config], ref, runs[NONE], base))
        if model != args.draft_model:  # done with it: free its memory for the next one
            session.loaded.pop(model, None)
    versus = [Column("versus", f"vs {args.versus}", ".2f")] if args.versus else []
    print(format_table(rows, [*COLUMNS[:6], *versus, *COLUMNS[6:]]))  # after `speedup`
    if args.out:
        write_outputs(rows, args.out, args)


def own_heads(args: argparse.Namespace) -> None:
    """Each model benchmarked with eagle3 has its own head in the cache: `train-head` makes
    one where none is, or a clear error with --head-minutes 0."""
    from specserve.bench import train_head
    from specserve.loading.eagle3 import has_own_head

    for model in args.models:
        chains = [chain_of(c) for c in configs_for(model, args)]
        if not any("eagle3" in chain for chain in chains) or has_own_head(model):
            continue
        if args.head_minutes <= 0:
            raise SpecserveError(
                f"no EAGLE-3 head for {model} in the cache: train one with `specserve "
                f"train-head --model {model}`, or give --head-minutes"
            )
        minutes = f"{args.head_minutes:g} minutes"
        print(f"no EAGLE-3 head for {model} in the cache: train-head, {minutes}", flush=True)
        train_head.train_own_head(model, args.head_minutes)


def compile_line(session: Session, model: str, grammar: Grammar) -> str:
    """How long a request's grammar takes to compile (the vocabulary's view, built once
    per model, is not in it)."""
    from specserve.grammar.constraint import build_constraint

    tok, vocab = session.tokenizer(model), session.load(model).cfg.vocab_size
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        build_constraint(tok, vocab, grammar)
        times.append(time.perf_counter() - t0)
    return f"[{model}] {grammar.kind} grammar compiles in {statistics.median(times) * 1e3:.2f} ms"
