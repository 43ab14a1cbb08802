"""What verifying a draft costs, in plain decode steps, from this machine's own forwards.

Speculation pays only when the tokens a draft is expected to add outweigh what its extra
verification rows cost. That cost is a property of the hardware, not of the model code: on
a GPU eight rows cost about what one does; on an AVX2 CPU in float32 the second row alone
almost doubles a step (MKL leaves the matrix-vector kernel), and more rows are cheap after
that. So the engine times every forward by its row count, and `ForwardCost` turns those
timings into the relative cost of k draft rows:

    cost(k) = 1 + (T(B + k) - T(B)) / (T(B) / B)

B being the rows the step has without drafts (one per decoding slot): the extra time the
k rows add, in units of one slot's share of a plain step. With one slot this is
T(1 + k) / T(1). T(n) is the median of recent forwards over n rows (measured: at least
MIN_SAMPLES among the last HORIZON forwards); between measured row counts it is
interpolated linearly; outside them it follows the prior 1 + PRIOR_PER_ROW per row from
the nearest measured point. Worked example, in any time unit, with T(1) = 100, T(2) = 190
and T(9) = 260 measured: cost(1) = 1.9, cost(8) = 2.6, cost(4) = 1 + (190 + 3/7 * 70
- 100) / 100 = 2.2.

Before serving, the engine times a few forwards of each of SEED_ROWS (`seed`): a run that
verifies drafts in most steps has few plain one-row steps, and T(1) was the median of the
few it had, so cost(k) moved with each of them.

Each timing is kept divided by the machine's speed at the time it was taken: the VMs this
was built on drift within minutes, and with drafts verified in most steps of a 4-slot
server, the plain 4-row step's timings were the last few seconds' while the 5-row ones were
spread over the whole run. A slow spell put the 4-row median above the 5-row one, so an
extra row looked free, every draft was verified, and the steps with drafts were slower than
plain ones (figures: docs/perf/cost.md). The speed is the median of the last PACE forwards'
times over their row count's median: the row counts seen often carry it, and the rare
ones' timings stay comparable.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence

# per extra row, in forwards, until this machine has measured its own (a CPU in float32 is
# 0.1-0.9 per row; a GPU ~0.01): high enough that speculation is not blind to verify cost
PRIOR_PER_ROW = 0.2
KEEP = 9  # timings kept per row count; their median resists one slow, interrupted step
# a row count counts as measured with at least MIN_SAMPLES timings among the last HORIZON
# forwards. Rare row counts (a 4-slot step plus one draft row) kept timings from minutes
# before, while the common one's were fresh; on VMs whose step time drifts within minutes,
# a stale 5-row median under a fresh 4-row one said an extra row was free, and every draft
# was verified at a loss (figures: docs/perf/cost.md)
HORIZON = 512
MIN_SAMPLES = 3
PACE = 5  # the speed is the median of the last PACE forwards' own: one interrupted step
# row counts timed before serving (`seed`): one slot's plain step and drafts of 1-16 tokens.
# Measured only while serving, a plain one-row step is rare once drafts are verified in most
# steps, and cost(k) rested on its few samples (figures: docs/perf/2026-11-28-eagle3-resumed.md)
SEED_ROWS = (1, 2, 3, 5, 9, 17)


class ForwardCost:
    """Seconds per forward by row count, measured as the engine runs (`record`), or only the
    fixed prior when `measure` is False (deterministic: for tests)."""

    def __init__(self, measure: bool = True, per_row: float = PRIOR_PER_ROW) -> None:
        self.measure = measure
        self.per_row = per_row
        # rows -> (forward no., seconds / the speed then)
        self._times: dict[int, deque[tuple[int, float]]] = {}
        self._forwards = 0
        self._speed = 0.0  # seconds per unit of the stored timings, now (0: none yet)
        self._pace: deque[float] = deque(maxlen=PACE)  # recent forwards' own speeds
        self._seeded = False

    def record(self, rows: int, seconds: float) -> None:
        if not (self.measure and rows > 0 and seconds > 0):
            return
        self._forwards += 1
        samples = self._times.setdefault(rows, deque(maxlen=KEEP))
        usual = self._median(samples)
        if not self._speed:  # the first forward sets the unit: a prior one-row forward
            self._speed = seconds / self._prior(rows)
        elif usual is not None:
            self._pace.append(seconds / usual)
            self._speed = statistics.median(self._pace)
        samples.append((self._forwards, seconds / self._speed))

    def seed(self, time_rows: Callable[[int], float], rows: Sequence[int] = SEED_ROWS) -> None:
        """Record MIN_SAMPLES timings of each row count before serving, the counts taken in
        turn so that a drift of the machine's speed meets them all alike; `time_rows(n)`
        runs one forward of n rows and returns its seconds. The first, cold forward is not
        kept. Live timings of a common row count soon push these out (KEEP); a rare one's
        (the plain step, under drafts) keep them until HORIZON forwards have passed. Engines
        sharing one cost (`bench spec --lockstep`) seed it once."""
        if not (self.measure and rows) or self._seeded:
            return
        self._seeded = True
        time_rows(rows[0])
        for _ in range(MIN_SAMPLES):
            for n in rows:
                self.record(n, time_rows(n))

    def seconds(self, rows: int) -> float:
        """T(rows), in seconds once measured, else in units of a prior one-row forward."""
        return self._at(self._known(), rows) * (self._speed or 1.0)

    def share_seconds(self, base_rows: int) -> float | None:
        """One slot's share of a plain step of `base_rows` rows, in seconds: T(B) / B, the
        unit cost(k) counts in; None until a forward has been timed."""
        if not self._speed:
            return None
        return self.seconds(max(1, base_rows)) / max(1, base_rows)

    def relative(self, base_rows: int, n_max: int) -> list[float]:
        """cost(k) for k = 0..n_max extra rows on a step of `base_rows` (see the module doc)."""
        known = self._known()  # once per step: the medians, not once per k
        base = max(1, base_rows)
        t_base = self._at(known, base)
        share = t_base / base
        return [1.0] + [
            1.0 + max(0.0, self._at(known, base + k) - t_base) / share for k in range(1, n_max + 1)
        ]

    def _known(self) -> list[tuple[int, float]]:
        """(rows, median of its kept timings) for every row count measured lately, by rows."""
        known = []
        for n, samples in self._times.items():
            median = self._median(samples)
            if median is not None:
                known.append((n, median))
        return sorted(known)

    def _median(self, samples: deque[tuple[int, float]]) -> float | None:
        """The median of the samples among the last HORIZON forwards, if MIN_SAMPLES are."""
        oldest = self._forwards - HORIZON
        recent = [t for i, t in samples if i > oldest]
        return statistics.median(recent) if len(recent) >= MIN_SAMPLES else None

    def _at(self, known: list[tuple[int, float]], rows: int) -> float:
        if not known:
            return self._prior(rows)
        below = [(n, t) for n, t in known if n <= rows]
        above = [(n, t) for n, t in known if n >= rows]
        if below and above:
            (n0, t0), (n1, t1) = below[-1], above[0]
            return t0 if n1 == n0 else t0 + (t1 - t0) * (rows - n0) / (n1 - n0)
        n, t = below[-1] if below else above[0]
        return t * self._prior(rows) / self._prior(n)

    def _prior(self, rows: int) -> float:
        return 1.0 + self.per_row * (rows - 1)
