"""The thread tuner's idle-core readings, taken from /proc/stat's per-CPU tick counts."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from specserve.engine.idle_cores import IdleCores


def _stat(path: Path, cpus: dict[int, list[int]]) -> None:
    """A /proc/stat with the aggregate line, the given CPUs and a line that is not a CPU."""
    total = [sum(col) for col in zip(*cpus.values(), strict=True)]
    lines = ["cpu  " + " ".join(map(str, total))]
    lines += [f"cpu{n} " + " ".join(map(str, ticks)) for n, ticks in cpus.items()]
    path.write_text("\n".join([*lines, "intr 5870955 0 0 1", "ctxt 12345"]) + "\n")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_cores_are_averaged_since_the_last_reading_over_this_process_cpus(
    tmp_path: Path,
) -> None:
    stat, clock = tmp_path / "stat", _Clock()
    # fields: user nice system idle iowait irq softirq steal guest guest_nice
    _stat(
        stat,
        {
            0: [100, 0, 10, 500, 5, 0, 1, 0, 0, 0],
            1: [80, 0, 8, 600, 2, 0, 0, 3, 0, 0],
            2: [0, 0, 0, 900, 0, 0, 0, 0, 0, 0],
        },
    )
    idle = IdleCores(str(stat), cpus=frozenset({0, 1}), period=0.25, clock=clock)
    assert idle() is None  # nothing to compare with yet
    clock.now += 0.3
    # cpu0: 20 busy + 5 idle ticks; cpu1: 2 busy, 15 idle, 3 iowait... and 5 stolen
    _stat(
        stat,
        {
            0: [115, 0, 15, 505, 5, 0, 1, 0, 0, 0],
            1: [81, 0, 9, 615, 5, 0, 0, 8, 0, 0],
            2: [0, 0, 0, 930, 0, 0, 0, 0, 0, 0],
        },
    )  # cpu2 is not this process's: left out
    assert idle() == pytest.approx(5 / 25 + 18 / 25)  # steal is not idle: no use to a thread
    clock.now += 0.1
    assert idle() is None  # too soon: too few ticks to say
    clock.now += 0.2
    _stat(stat, {0: [140, 0, 15, 505, 5, 0, 1, 0, 0, 0], 1: [81, 0, 9, 640, 5, 0, 0, 8, 0, 0]})
    assert idle() == pytest.approx(0 + 1)  # read against the last reading, not the first


def test_an_unreadable_stat_gives_no_reading_and_the_default_cpus_are_this_process(
    tmp_path: Path,
) -> None:
    idle = IdleCores(str(tmp_path / "missing"), period=0.0)
    assert idle() is None and idle() is None
    assert idle.cpus == frozenset(os.sched_getaffinity(0))


def test_the_real_proc_stat_reads_within_this_process_cpus() -> None:
    idle = IdleCores(period=0.0)
    assert idle() is None
    time.sleep(0.1)  # let ~10 ticks pass
    reading = idle()
    assert reading is not None and 0.0 <= reading <= len(idle.cpus)
