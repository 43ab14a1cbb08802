"""`bench spec --lockstep`: a round's configurations decode side by side, one engine step of
each in turn, each timed by its own steps, and generate what each would alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from specserve.bench.spec_rounds import Started, lockstep, serve_first
from specserve.cli import build_parser
from specserve.engine.request import Request, SpecParams
from specserve.engine.sampling import SamplingParams
from specserve.engine.setup import EngineSettings, build_engine
from specserve.loading.model import load_model
from specserve.speculative.chain import ChainSpeculator
from specserve.speculative.suffix import SuffixSpeculator
from tests.tiny import write_hf_folder

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 3, 1, 4, 1, 5]


def _started(folder: Path, types: tuple[str, ...], target, n: int) -> Started:  # noqa: ANN001
    s = EngineSettings(str(folder), "float32", ctx_size=96, spec_types=types)
    engine, _ = build_engine(s, target=target, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=n)
    return Started(engine, Request(PROMPT, params, SpecParams(n_max=8 if types else 0)))


def test_side_by_side_engines_generate_what_each_would_alone(tmp_path: Path) -> None:
    write_hf_folder("qwen2", tmp_path, seed=3)
    target = load_model(tmp_path, "float32", with_tokenizer=False)
    configs = {"none": (), "chain": ("ngram-map-k", "suffix")}
    alone = {}
    for name, types in configs.items():
        s = _started(tmp_path, types, target, 40)
        s.engine.generate([s.req])
        alone[name] = list(s.req.output)
    runs = lockstep({n: _started(tmp_path, t, target, 40) for n, t in configs.items()})
    assert {n: r.tokens for n, r in runs.items()} == alone
    assert len(alone["none"]) == 40
    for name, r in runs.items():
        assert r.tok_s > 0 and 39 / r.tok_s <= r.seconds, name  # decode within its own time
    assert runs["none"].stats is None and runs["chain"].drafts > 0


@dataclass
class _Engine:
    """Steps as a log entry; the first step gives one token, every later one `per_step`."""

    name: str
    steps: int
    log: list[str]
    per_step: int = 1
    speculator: None = None
    threads: None = None
    req: Request | None = field(default=None)
    branches_verified: int = 0
    branches_kept: int = 0

    def add_request(self, req: Request) -> None:
        self.req = req

    def step(self) -> None:
        assert self.req is not None
        self.log.append(self.name)
        self.steps -= 1
        self.req.output.extend([7] * (1 if not self.req.output else self.per_step))

    def has_work(self) -> bool:
        return self.steps > 0


def test_steps_take_turns_each_turn_starting_one_further_and_a_finished_engine_drops_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[str] = []
    clock = iter(float(t) for t in range(1000))  # each step takes one second
    monkeypatch.setattr("specserve.bench.spec_rounds.time.perf_counter", lambda: next(clock))
    engines = {"a": _Engine("a", 4, log), "b": _Engine("b", 2, log, per_step=3)}
    runs = lockstep({n: Started(e, Request([1], SamplingParams())) for n, e in engines.items()})  # type: ignore[arg-type]
    assert log == ["a", "b", "b", "a", "a", "a"]
    # the first step (the prompt's) is not decoding: a's 3 later tokens in 3 s, b's 3 in 1 s
    assert runs["a"].tok_s == pytest.approx(1.0) and runs["a"].seconds == pytest.approx(4.0)
    assert runs["b"].tok_s == pytest.approx(3.0) and runs["b"].seconds == pytest.approx(2.0)
    assert runs["a"].tokens == [7] * 4 and runs["b"].tokens == [7] * 4


def test_three_engines_take_every_place_in_a_turn_alike() -> None:
    """Reversed every other turn, the middle one of three stayed in the middle."""
    log: list[str] = []
    engines = {n: _Engine(n, 3, log) for n in "abc"}
    lockstep({n: Started(e, Request([1], SamplingParams())) for n, e in engines.items()})  # type: ignore[arg-type]
    turns = [log[i : i + 3] for i in range(0, 9, 3)]
    assert turns == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


def test_lockstep_flag() -> None:
    assert not build_parser().parse_args(["bench", "spec"]).lockstep
    assert build_parser().parse_args(["bench", "spec", "--lockstep"]).lockstep


def test_an_engine_served_first_keeps_what_it_learnt_and_reports_its_own_request(
    tmp_path: Path,
) -> None:
    """--served-first: the engine answers other asks before the timed one, as another
    tenant. Its drafters' rates carry what they learnt there, none of their text reaches the
    timed request's tenant, the counters the run reports start at that request, and the
    output is still what plain decoding gives."""
    write_hf_folder("qwen2", tmp_path, seed=3)
    target = load_model(tmp_path, "float32", with_tokenizer=False)
    plain = _started(tmp_path, (), target, 40)
    plain.engine.generate([plain.req])
    chain = ("ngram-map-k", "suffix")
    fresh = _started(tmp_path, chain, target, 40)
    # the timed prompt itself among them: shared text would let suffix copy its answer
    served = serve_first(fresh, [PROMPT[3:] + PROMPT[:3], PROMPT])
    spec = served.engine.speculator
    assert isinstance(spec, ChainSpeculator)
    suffix = next(c for c in spec.children if isinstance(c, SuffixSpeculator))
    assert suffix.global_tokens == 0  # the timed request's tenant holds nothing yet
    assert suffix.rates.overall.reached  # learnt from the asks served first
    for s in [spec, *spec.children]:
        assert s.stats.drafts_generated == 0 and s.stats.draft_seconds == 0.0, s.name
    cold = _started(tmp_path, chain, target, 40)
    assert not any(c.rates.overall.reached for c in cold.engine.speculator.children)
    run = lockstep({"served": served})["served"]
    assert run.tokens == plain.req.output
    assert 0 < run.drafts < len(run.tokens)  # one a step at most: its own steps' alone
