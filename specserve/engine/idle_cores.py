"""How many of this process's cores sat idle lately, as the kernel counts it in /proc/stat.

The thread tuner (engine/threads.py) needs this while it runs forwards on one thread: a
load on the other cores that leaves does not change a one-thread step's time, so timing
alone cannot tell that all cores would now be faster, and trying them often costs where
the load stays (a two-thread forward then waits for the descheduled thread). The kernel's
idle counts tell it without running anything.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

PERIOD = 0.25  # seconds between readings: /proc/stat counts 10 ms ticks, ~25 a core then


def _affinity() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux: nothing will be read anyway
        return frozenset()


class IdleCores:
    """Call it to get the idle cores (0 to the number of this process's CPUs) averaged since
    its previous reading, or None when that reading is under `period` seconds old (too few
    ticks to say), when there is none yet, or when /proc/stat cannot be read."""

    def __init__(
        self,
        path: str = "/proc/stat",
        cpus: frozenset[int] | None = None,
        period: float = PERIOD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path, self.period, self.clock = path, period, clock
        self.cpus = _affinity() if cpus is None else cpus
        self._last: tuple[float, dict[int, tuple[int, int]]] | None = None

    def __call__(self) -> float | None:
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.period:
            return None
        counts = self._read()
        if counts is None:
            return None
        last, self._last = self._last, (now, counts)
        if last is None:
            return None
        idle = 0.0
        for cpu, (busy, total) in counts.items():
            before = last[1].get(cpu)
            if before is None or total <= before[1]:
                continue  # no ticks counted on it since: no evidence either way
            idle += 1 - (busy - before[0]) / (total - before[1])
        return idle

    def _read(self) -> dict[int, tuple[int, int]] | None:
        """Per CPU of this process: (ticks not idle, all ticks). Steal counts as not idle:
        a core the hypervisor takes away is no more use to a second thread than a busy one."""
        try:
            with open(self.path, encoding="ascii") as f:
                lines = f.readlines()
        except OSError:
            return None
        counts = {}
        for line in lines:
            name, _, rest = line.partition(" ")
            if (
                not name.startswith("cpu")
                or not name[3:].isdigit()
                or int(name[3:]) not in self.cpus
            ):
                continue
            # user nice system idle iowait irq softirq steal (guest time is inside user)
            ticks = [int(x) for x in rest.split()[:8]]
            total = sum(ticks)
            counts[int(name[3:])] = (total - ticks[3] - ticks[4], total)
        return counts
