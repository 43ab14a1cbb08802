"""`specserve bench spec`: its pure helpers and flags (the benchmark needs real models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.bench.spec import CONFIGS, configs_for, main, own_heads
from specserve.bench.spec_report import (
    Run,
    fewer_threads,
    first_difference,
    histogram,
    make_row,
    paired,
    progress_line,
)
from specserve.bench.spec_rounds import Started, Warm, rounds
from specserve.bench.spec_workloads import UNTUNED, messages
from specserve.cli import build_parser
from specserve.engine.request import Request
from specserve.engine.sampling import SamplingParams
from specserve.engine.threads import ThreadTuner
from specserve.errors import SpecserveError
from specserve.speculative.cost import ForwardCost


@pytest.mark.parametrize(
    ("counts", "text"),
    [
        pytest.param([], "-", id="no-drafts"),
        pytest.param([5, 2, 0, 1, 0, 3], "0:5 1:2 3-4:1 5-8:3", id="buckets"),
        pytest.param([0] * 16 + [4], "9-16:4", id="all-accepted-16"),
        pytest.param([1] * 18, "0:1 1:1 2:1 3-4:2 5-8:4 9-16:8 17-32:1", id="every-length"),
    ],
)
def test_histogram(counts: list[int], text: str) -> None:
    assert histogram(counts) == text


@pytest.mark.parametrize(
    ("a", "b", "index"),
    [
        pytest.param([1, 2, 3], [1, 2, 3], None, id="equal"),
        pytest.param([1, 2, 3], [1, 5, 3], 1, id="differs"),
        pytest.param([1, 2, 3], [1, 2], 2, id="longer"),
        pytest.param([], [7], 0, id="empty"),
    ],
)
def test_first_difference(a: list[int], b: list[int], index: int | None) -> None:
    assert first_difference(a, b) == index


def test_draft_configs_are_skipped_for_the_draft_model_itself() -> None:
    args = build_parser().parse_args(["bench", "spec"])
    assert args.spec_types == list(CONFIGS)
    small = configs_for("qwen2.5-coder-0.5b", args)
    assert small[0] == "none"
    assert not any("draft" in c for c in small)
    assert configs_for("qwen2.5-coder-1.5b", args) == ["none", *CONFIGS]


def test_models_load_as_a_server_loads_them() -> None:
    args = build_parser().parse_args(["bench", "spec"])
    assert args.weights == "auto"  # `specserve serve`'s default, so tok/s is what users see
    assert build_parser().parse_args(["bench", "spec", "--weights", "dequant"]).weights == "dequant"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "spec", "--weights", "int3"])


def _runs(*tok_s: float) -> list[Run]:
    return [Run([1, 2], t, 1.0, None) for t in tok_s]


def test_speedup_is_the_median_of_each_rounds_own_ratio() -> None:
    """A slow spell during the first round's `none` run makes that round's ratio 3.0:
    paired, it is one ratio among three; as a ratio of median speeds (30 over 20) the
    chain would have read 1.5x."""
    ref = _runs(0.0)[0]
    plain, chain, head = _runs(10, 40, 20), _runs(30, 44, 21), _runs(27, 48, 20)
    row = make_row("m", "w", "chain", chain, ref, plain)
    assert row["speedup_runs"] == pytest.approx([3.0, 1.1, 1.05])
    assert row["speedup"] == pytest.approx(1.1) and row["versus"] is None
    row = make_row("m", "w", "head", head, ref, plain, versus=chain)
    assert row["versus_runs"] == pytest.approx([0.9, 48 / 44, 20 / 21])
    assert row["versus"] == pytest.approx(20 / 21)
    with pytest.raises(ValueError, match="rounds pair one to one"):
        paired(head, plain[:2])


class _Rounds:
    """A session that records the order it is asked to generate in, and the row costs each
    engine was given."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.costs: list[object] = []
        self.clock = 0.0  # seconds since the load: each run takes 10

    def prompt(self, model: str, workload: str) -> list[int]:
        return [0]

    def prediction(self, model: str, workload: str) -> list[int]:
        return []

    def since_load(self) -> float:
        return self.clock

    def start(self, model: str, config: str, prompt: list[int], **kw: object) -> Started:
        self.costs.append(kw["cost"])
        return Started(_Generating(self, config), Request(prompt, SamplingParams()))  # type: ignore[arg-type]


class _Generating:
    """An engine whose run is logged in its session's order and takes 10 s of its clock."""

    speculator = None
    threads = None
    branches_verified = branches_kept = 0

    def __init__(self, session: _Rounds, config: str) -> None:
        self.session, self.config = session, config

    def generate(self, requests: list[Request]) -> None:
        self.session.order.append(self.config)
        self.session.clock += 10.0
        requests[0].output.extend([1, 2])

    # lockstep's engine: the whole run is one step
    def add_request(self, req: Request) -> None:
        self.req = req

    def step(self) -> None:
        self.generate([self.req])

    def has_work(self) -> bool:
        return not self.req.output


def test_rounds_alternate_their_order_and_reuse_the_reference() -> None:
    session, ref = _Rounds(), _runs(1.0)[0]
    runs = rounds(session, "m", "w", ["none", "a", "b"], ref, 3)  # type: ignore[arg-type]
    assert session.order == ["a", "b", "b", "a", "none", "none", "a", "b"]
    assert runs["none"][0] is ref and [len(r) for r in runs.values()] == [3, 3, 3]
    assert session.costs == [None] * 8  # a lone run's engine times its own rows


@pytest.mark.parametrize(
    ("warm", "warmed"), [(Warm(rounds=2), 2), (Warm(rounds=1, seconds=45), 3), (Warm(0, 5), 1)]
)
def test_warm_rounds_go_first_and_are_not_counted(warm: Warm, warmed: int) -> None:
    """At least `rounds` of them, and more until `seconds` have passed since the load."""
    session, ref = _Rounds(), _runs(1.0)[0]
    runs = rounds(session, "m", "w", ["none", "a", "b"], ref, 2, warm)  # type: ignore[arg-type]
    first = (["a", "b"], ["b", "a"])
    assert session.order == [
        *(c for i in range(warmed) for c in first[i % 2]),
        *["none", "a", "b", "b", "a", "none"],
    ]
    assert runs["none"][0] is not ref and [len(r) for r in runs.values()] == [2, 2, 2]


def test_rounds_together_run_every_configuration_each_round_and_time_them_all() -> None:
    session, ref = _Rounds(), _runs(1.0)[0]
    runs = rounds(session, "m", "w", ["none", "a", "b"], ref, 2, Warm(1), together=True)  # type: ignore[arg-type]
    assert session.order == ["a", "b", "none", "a", "b", "none", "a", "b"]
    # a round's engines time their rows into one cost, a fresh one each round
    assert all(isinstance(c, ForwardCost) for c in session.costs)
    assert [len({id(c) for c in r}) for r in (session.costs[:2], session.costs[2:5])] == [1, 1]
    assert len({id(c) for c in session.costs[::3]}) == 3
    assert all(r is not ref for r in runs["none"]) and [len(r) for r in runs.values()] == [2, 2, 2]


def test_versus_must_be_a_benchmarked_configuration() -> None:
    args = build_parser().parse_args(["bench", "spec", "--spec-types", "suffix", "--versus", "x"])
    with pytest.raises(SpecserveError, match="--versus x"):
        main(args)


def test_an_ask_served_first_is_not_also_benchmarked() -> None:
    argv = ["bench", "spec", "--workloads", "prose", "quicksort-c", "--served-first"]
    args = build_parser().parse_args([*argv, "stack-c", "prose"])
    with pytest.raises(SpecserveError, match="--served-first prose: also benchmarked"):
        main(args)
    assert build_parser().parse_args(argv[:-1]).served_first == []


def _heads_args(*argv: str):  # noqa: ANN202 (the parsed flags)
    return build_parser().parse_args(["bench", "spec", "--models", "m1", "m2", *argv])


def test_a_model_without_its_head_trains_one_before_the_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """m1 has only a stopped run's checkpoint (no head a server could load), m2 a saved
    head: only m1 is trained, with --head-minutes; configurations without eagle3 train
    nothing, and `shared:` chains with it count."""
    from specserve.loading.eagle3 import has_own_head, save_eagle3
    from specserve.loading.hf import config_from_hf
    from tests.tiny import hf_config
    from tests.tiny_eagle3 import random_head

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    (tmp_path / "heads" / "m1-eagle3").mkdir(parents=True)
    (tmp_path / "heads" / "m1-eagle3" / "checkpoint.pt").write_bytes(b"")
    save_eagle3(
        random_head(config_from_hf(hf_config("qwen2").to_dict())), tmp_path / "heads" / "m2-eagle3"
    )
    assert not has_own_head("m1") and has_own_head("m2")
    from specserve.bench import train_head

    trained: list[tuple[str, float]] = []
    monkeypatch.setattr(train_head, "train_own_head", lambda *call: trained.append(call))

    own_heads(_heads_args("--spec-types", "suffix", "suffix,eagle3", "--head-minutes", "7"))
    assert trained == [("m1", 7.0)]
    own_heads(_heads_args("--spec-types", "shared:eagle3"))
    assert trained == [("m1", 7.0), ("m1", 120.0)]  # the budget by default
    own_heads(_heads_args("--spec-types", "suffix", "draft"))
    assert len(trained) == 2


def test_no_head_and_no_minutes_to_train_one_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    args = _heads_args("--spec-types", "eagle3", "--head-minutes", "0")
    with pytest.raises(SpecserveError, match="train-head --model m1"):
        main(args)


def test_the_head_trained_for_a_benchmark_is_train_heads_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flags it trains with are `specserve train-head --model M --minutes N`'s."""
    from specserve.bench import train_head

    seen: list[object] = []
    monkeypatch.setattr(train_head, "main", seen.append)
    train_head.train_own_head("m", 7.0)
    cli = build_parser().parse_args(["train-head", "--model", "m", "--minutes", "7"])
    assert {k: v for k, v in vars(cli).items() if k not in ("func", "command")} == vars(seen[0])


@pytest.mark.parametrize(
    ("workload", "asked"),
    [
        pytest.param("quicksort-c", "Write a quicksort demo in C.", id="quicksort"),
        pytest.param("mergesort-python", "Write a merge sort demo in Python.", id="untuned"),
        pytest.param("bfs-java", "Write a breadth-first search demo in Java.", id="bfs"),
        pytest.param("prose-clockmaker", "Write a short story about a clockmaker.", id="story"),
    ],
)
def test_workloads_ask_for_their_program(workload: str, asked: str) -> None:
    (turn,) = messages(workload, None)
    assert turn["role"] == "user" and turn["content"].startswith(asked)


def test_untuned_workloads_run_only_when_named() -> None:
    args = build_parser().parse_args(["bench", "spec"])
    assert not set(args.workloads) & set(UNTUNED)
    named = build_parser().parse_args(["bench", "spec", "--workloads", "stack-c", "quicksort-c"])
    assert named.workloads == ["stack-c", "quicksort-c"]
    rewrite = messages("rewrite-java", "class Q {}")
    assert rewrite[0]["content"].startswith("Write a quicksort demo in Java.")
    assert rewrite[1] == {"role": "assistant", "content": "class Q {}"}


def test_fewer_threads_counts_the_forwards_under_all_cores() -> None:
    assert fewer_threads({2: 140, 1: 12}, 2) == "12 of 152 forwards on 1 thread"
    assert fewer_threads({2: 150}, 2) == "" and fewer_threads({}, 2) == ""
    assert fewer_threads({1: 5, 2: 3, 4: 2}, 4) == (
        "5 of 10 forwards on 1 thread, 3 of 10 forwards on 2 threads"
    )


def test_a_run_names_its_own_forwards_the_tuner_kept_on_one_thread() -> None:
    """Only the timed request's forwards: not those of the asks an engine served first."""

    class Engine:
        speculator = None
        threads = ThreadTuner(max_threads=2)
        branches_verified = branches_kept = 0

    engine = Engine()
    for t in (1, 1, 2):  # served before the timed request
        engine.threads.record(1, t, 0.01)
    started = Started(engine, Request([1], SamplingParams()))  # type: ignore[arg-type]
    for t in (2, 1, 2, 2):
        engine.threads.record(1, t, 0.01)
    run = started.run(10.0, 1.0)
    assert run.threads == "1 of 4 forwards on 1 thread"
    assert progress_line("m", "w", "c", run).endswith("(1 of 4 forwards on 1 thread)")
