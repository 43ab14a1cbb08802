"""The thread tuner runs forwards on the faster thread count, and the count never changes
a result (what makes tuning it safe for exactness)."""

from __future__ import annotations

import threading

import pytest
import torch

from specserve.engine.threads import BURST, MARGIN, RETRY, ComputeThread, ThreadTuner
from specserve.models.layers.packed import PackedLinear


def _run(tuner: ThreadTuner, rows: int, seconds: dict[int, float], steps: int) -> list[int]:
    picked = []
    for _ in range(steps):
        t = tuner.pick(rows)
        tuner.record(rows, t, seconds[t])
        picked.append(t)
    return picked


def test_tries_both_then_keeps_the_faster_and_retries_the_other() -> None:
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(max_threads=2)
        picked = _run(tuner, 1, {1: 0.10, 2: 0.06}, 4 + 2 * RETRY)
        assert picked[:4] == [1, 1, 2, 2]  # two timings of each first
        assert tuner.best(1) == 2
        # one try of the slower per RETRY forwards, BURST forwards long
        assert picked[4:].count(1) == 2 * BURST
        assert [1] * BURST in [picked[i : i + BURST] for i in range(4, len(picked))]
        assert torch.get_num_threads() == picked[-1]
        # the load changes: one thread becomes the faster, and the tuner follows
        _run(tuner, 1, {1: 0.10, 2: 0.30}, 3 * RETRY)
        assert tuner.best(1) == 1
        # buckets are separate: 8 rows has measured nothing yet
        assert tuner.best(8) is None and tuner.best(9) is None
    finally:
        torch.set_num_threads(before)


def test_a_try_ignores_its_first_forward_and_one_thread_needs_a_margin() -> None:
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(max_threads=2)
        _run(tuner, 1, {1: 0.10, 2: 0.06}, 4)
        _run(tuner, 1, {1: 0.05, 2: 0.10}, RETRY)  # the load changes: one thread is faster
        assert tuner.best(1) == 1
        # a try of two threads whose first forward is slow (cold workers) and the rest fast
        picked, times = [], iter([0.5] + [0.04] * 10)
        for _ in range(2 * RETRY):
            t = tuner.pick(1)
            tuner.record(1, t, next(times) if t == 2 else 0.05)
            picked.append(t)
        assert 0.5 not in tuner._times[(1, 2)]
        assert tuner.best(1) == 2 and picked[-1] == 2  # the try's fast forwards won it back
        # one thread only a little faster than two: not enough to leave all cores
        tuner = ThreadTuner(max_threads=2)
        _run(tuner, 1, {1: 0.10, 2: 0.10 * MARGIN * 0.99}, 4)
        assert tuner.best(1) == 2
    finally:
        torch.set_num_threads(before)


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


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
def test_packed_float32_linear_gives_the_same_bits_on_1_and_2_threads(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(896, 4864)
    layer = PackedLinear(linear)
    x = torch.randn(rows, 896, generator=g)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(layer(x))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
