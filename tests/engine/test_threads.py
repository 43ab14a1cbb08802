"""The thread tuner runs forwards on the faster thread count, and the count never changes
a result (what makes tuning it safe for exactness)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence

import pytest
import torch

from specserve.engine import threads as threads_module
from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.engine.threads import (
    BURST,
    FIRST_TRY,
    MARGIN,
    RETRY,
    RETRY_MAX,
    ComputeThread,
    ThreadTuner,
)
from specserve.loading.model import load_model
from specserve.models.layers.packed import PackedLinear
from specserve.speculative.base import Draft, DraftRequest, Speculator
from specserve.speculative.cost import ForwardCost
from tests.tiny import write_hf_folder


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """The tuner sets torch's thread count: give the next test the count it had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _run(tuner: ThreadTuner, rows: int, seconds: dict[int, float], steps: int) -> list[int]:
    picked = []
    for _ in range(steps):
        t = tuner.pick(rows)
        tuner.record(rows, t, seconds[t])
        picked.append(t)
    return picked


def _tries(picked: list[int]) -> list[int]:
    """Where each run of one-thread forwards (a try, while two threads are preferred) starts."""
    return [i for i, t in enumerate(picked) if t == 1 and (i == 0 or picked[i - 1] != 1)]


@pytest.mark.usefixtures("restore_threads")
def test_starts_on_all_cores_then_tries_one_thread_less_and_less_often() -> None:
    tuner = ThreadTuner(max_threads=2)
    assert tuner.best(1) == 2  # nothing measured: all cores, what a quiet machine wants
    picked = _run(tuner, 1, {1: 0.10, 2: 0.06}, 2000)
    starts = _tries(picked)
    assert picked[:FIRST_TRY] == [2] * FIRST_TRY and starts[0] == FIRST_TRY
    assert all(picked[i : i + BURST] == [1] * BURST for i in starts)
    # each try that changed nothing doubles the gap to the next, up to RETRY_MAX
    gaps = [b - a - BURST for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[:6] == [RETRY, 2 * RETRY, 4 * RETRY, 8 * RETRY, RETRY_MAX, RETRY_MAX]
    assert picked.count(1) < 0.03 * len(picked)  # was one try per RETRY: 12 %
    assert torch.get_num_threads() == picked[-1] == 2
    # buckets are separate: 8 rows has measured nothing and starts on all cores
    assert tuner.pick(8) == 2 and tuner.pick(9) == 2


@pytest.mark.usefixtures("restore_threads")
def test_a_load_change_brings_the_next_try_forward_and_a_flip_resets_the_gap() -> None:
    tuner = ThreadTuner(max_threads=2)
    _run(tuner, 1, {1: 0.10, 2: 0.06}, 1000)  # quiet: the gap is at its longest
    # outside load arrives: two threads become 5x slower, one thread 1.5x
    picked = _run(tuner, 1, {1: 0.15, 2: 0.30}, 10)
    assert 1 in picked[:6]  # tried within a few forwards, not RETRY_MAX later
    assert tuner.best(1) == 1 and picked[-1] == 1
    # the load leaves: one thread is faster too, so two threads are tried soon
    picked = _run(tuner, 1, {1: 0.10, 2: 0.06}, RETRY + 2 * BURST)
    assert tuner.best(1) == 2 and picked[-1] == 2


@pytest.mark.usefixtures("restore_threads")
def test_a_try_ignores_its_first_forward_and_one_thread_needs_a_margin() -> None:
    tuner = ThreadTuner(max_threads=2)
    _run(tuner, 1, {1: 0.05, 2: 0.10}, FIRST_TRY + BURST)  # one thread is faster
    assert tuner.best(1) == 1
    # a try of two threads whose first forward is slow (cold workers) and the rest fast
    picked, times = [], itertools.chain([0.5], itertools.repeat(0.04))
    for _ in range(2 * RETRY):
        t = tuner.pick(1)
        tuner.record(1, t, next(times) if t == 2 else 0.05)
        picked.append(t)
    assert 0.5 not in tuner._times[(1, 2)]
    assert tuner.best(1) == 2 and picked[-1] == 2  # the try's fast forwards won it back
    # one thread only a little faster than two: not enough to leave all cores
    tuner = ThreadTuner(max_threads=2)
    _run(tuner, 1, {1: 0.10, 2: 0.10 * MARGIN * 0.99}, FIRST_TRY + BURST)
    assert tuner.best(1) == 2


class _Idle:
    """Idle-core readings for the tuner: a fixed value, counting how often it is read."""

    def __init__(self, cores: float) -> None:
        self.cores, self.reads = cores, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.cores


@pytest.mark.usefixtures("restore_threads")
def test_idle_cores_bring_two_threads_back_soon_after_a_load_leaves() -> None:
    loaded, quiet = {1: 0.10, 2: 0.30}, {1: 0.10, 2: 0.06}  # one thread keeps its own core
    idle = _Idle(0.0)
    sensing, timing = ThreadTuner(max_threads=2, idle=idle), ThreadTuner(max_threads=2)
    # under a load that stays the other core is busy: the same forwards as timing alone
    assert _run(sensing, 1, loaded, 1000) == _run(timing, 1, loaded, 1000)
    assert idle.reads > 900 and sensing.best(1) == timing.best(1) == 1
    # the load leaves: a one-thread step's time does not change, so timing alone waits out
    # the gap it grew under the load, while the idle core brings a try at once
    idle.cores = 1.0
    sensed, timed = _run(sensing, 1, quiet, RETRY), _run(timing, 1, quiet, RETRY)
    assert sensed[: BURST + 1] == [1, 2, 2, 2] and sensed[-1] == 2 and sensing.best(1) == 2
    assert timed == [1] * RETRY and timing.best(1) == 1
    # on two threads the idle counts are not read: they cost nothing on a quiet machine
    reads = idle.reads
    _run(sensing, 1, quiet, RETRY)
    assert idle.reads == reads


@pytest.mark.usefixtures("restore_threads")
def test_a_sensed_try_that_keeps_one_thread_disarms_sensing_until_the_next_try() -> None:
    """Idle cores that mislead (one thread is faster all the same) cost one try more per
    scheduled try, not a try per reading."""
    faster_alone = {1: 0.05, 2: 0.10}
    sensing = ThreadTuner(max_threads=2, idle=_Idle(1.0))
    picked = _run(sensing, 1, faster_alone, 2000)
    timed = _run(ThreadTuner(max_threads=2), 1, faster_alone, 2000)
    assert sensing.best(1) == 1 and picked[-1] == 1
    extra = len(_tries([3 - t for t in picked])) - len(_tries([3 - t for t in timed]))
    assert 1 <= extra <= len(_tries([3 - t for t in timed])) + 1
    assert picked.count(2) < 0.06 * len(picked)


def _fail() -> None:
    raise ValueError("boom")


def test_compute_thread_runs_every_job_in_order_on_one_thread() -> None:
    compute = ComputeThread("test-compute")
    idents = {compute.call(threading.get_ident) for _ in range(3)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    order: list[int] = []
    done = [compute.submit(lambda i=i: order.append(i)) for i in range(5)]
    for d in done:
        d.result(5)
    assert order == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="boom"):
        compute.call(_fail)
    assert compute.call(lambda: 7) == 7  # a failed job does not end the thread
    compute.close()
    compute._thread.join(5)
    assert not compute._thread.is_alive()


def test_one_core_means_one_option() -> None:
    assert ThreadTuner(max_threads=1).options == (1,)


@pytest.mark.usefixtures("restore_threads")
def test_a_tuner_built_after_one_that_left_torch_on_one_thread_still_offers_all_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bench builds an engine per run: one born after a run that ended on a try's one
    thread took that for all the cores there were, and so did every engine after it."""
    monkeypatch.setattr(threads_module, "CORES", 4)
    first = ThreadTuner()
    _run(first, 1, {1: 0.05, 2: 0.10, 4: 0.10}, FIRST_TRY + BURST)
    assert first.best(1) == 1 and torch.get_num_threads() == 1
    assert ThreadTuner().options == (1, 4) and ThreadTuner().pick(1) == 4


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
@pytest.mark.usefixtures("restore_threads")
def test_packed_float32_linear_gives_the_same_bits_on_1_and_2_threads(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(896, 4864)
    layer = PackedLinear(linear)
    x = torch.randn(rows, 896, generator=g)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(layer(x))
    assert torch.equal(outs[0], outs[1])


class _Trying(ThreadTuner):
    """Every other forward is a try on one thread while two stay the choice."""

    def __init__(self) -> None:
        super().__init__(max_threads=2)
        self.calls = 0

    def pick(self, rows: int) -> int:
        self.calls += 1
        threads = 1 if self.calls % 2 == 0 else 2
        torch.set_num_threads(threads)
        return threads

    def best(self, rows: int) -> int:
        return 2


class _Cost(ForwardCost):
    def __init__(self) -> None:
        super().__init__(measure=True)
        self.recorded: list[int] = []

    def record(self, rows: int, seconds: float) -> None:
        self.recorded.append(rows)
        super().record(rows, seconds)


@pytest.mark.usefixtures("restore_threads")
def test_the_verify_cost_is_measured_on_decode_steps_on_the_chosen_thread_count_only(
    tmp_path,  # noqa: ANN001
) -> None:
    write_hf_folder("qwen2", tmp_path, seed=1)
    model = load_model(tmp_path, dtype="float64").model
    cost, tuner = _Cost(), _Trying()
    engine = Engine(ModelRunner(model, num_slots=1, max_len=64), cost=cost, threads=tuner)
    engine.generate([Request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6))])
    assert tuner.calls == 6  # the prompt pass and 5 decode steps
    assert len(cost.recorded) == 2  # decode steps on the chosen count: calls 3, 5 (1: prompt)


class _ThreadsSeen(Speculator):
    """Drafts nothing; notes the thread count torch has each time it is asked."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.seen.append(torch.get_num_threads())
        return [Draft() for _ in requests]


@pytest.mark.usefixtures("restore_threads")
def test_drafting_runs_on_the_chosen_thread_count_not_on_a_tries(tmp_path) -> None:  # noqa: ANN001
    write_hf_folder("qwen2", tmp_path, seed=1)
    model = load_model(tmp_path, dtype="float64").model
    spec = _ThreadsSeen()
    runner = ModelRunner(model, num_slots=1, max_len=64)
    engine = Engine(runner, spec, threads=_Trying())
    params = SamplingParams(temperature=0.0, max_tokens=6)
    engine.generate([Request([1, 2, 3], params, SpecParams(n_max=2))])
    assert len(spec.seen) >= 2 and set(spec.seen) == {2}  # every other one after a try
