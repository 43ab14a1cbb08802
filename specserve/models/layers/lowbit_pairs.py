"""From how many rows the VNNI kernels walk two tiles per 512-bit vector: timed per CPU.

A VNNI call of `pair_rows` rows or more runs each instruction over two tiles' records at
once (ops/cpu/lowbit_vnni.cpp); fewer rows run one tile per 256-bit vector. Which is faster
at few rows depends on the CPU, not on the model: on a Zen 4, which splits 512-bit
instructions in halves, pairs made two rows dearer, so the kernels start them at 4 rows; on
an Intel Xeon they made a one-row forward faster and a second row nearly free
(docs/perf/2026-12-01-xeon-pairs.md). So loading a model times its own low-bit calls with
1..ROWS rows both ways and keeps pairs from the fewest rows at which they win at every count
up to ROWS. Both walks give the same bits, so the choice moves speed only.
SPECSERVE_PAIR_ROWS=N sets it instead.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from operator import truediv

import torch
from torch import nn

from specserve.errors import SpecserveError
from specserve.models.layers.lowbit import LowbitCall, kernel_isa
from specserve.ops.cpu.build import load

# the row counts timed: a plain step's one row and a verification's few; from 4 rows up the
# kernels always pair (their default)
ROWS = 3
DEFAULT = ROWS + 1
# rounds timed after one that warms, every case once a round (`time_pairs`): with 3, a slow
# stretch now and then still made one row count's ratio fall under 1
# (docs/perf/2026-12-01-xeon-pairs.md)
ROUNDS = 5
# a model whose low-bit records are fewer bytes than this is not timed (tests' tiny models):
# its calls are too short to tell the walks apart
LEAST_BYTES = 64 << 20
ENV = "SPECSERVE_PAIR_ROWS"
# what this process's first timing chose: the CPU's property, not a model's, so a second
# model (a draft model, a benchmark's next) takes it without timing again
_chosen: int | None = None


def kernel_pair_rows(rows: int = 0) -> int:
    """The row count from which VNNI calls pair tiles; `rows` > 0 sets it."""
    return int(load().lowbit_pair_rows(rows))


def threshold(single: Sequence[float], paired: Sequence[float]) -> int:
    """pair_rows from the seconds of calls of 1..len rows, one tile at a time and paired:
    one past the most rows at which one tile at a time was faster (1: pairs won at every
    count)."""
    lost = [m for m, (s, p) in enumerate(zip(single, paired, strict=True), 1) if s < p]
    return max(lost, default=0) + 1


def tune_pairs(model: nn.Module) -> int | None:
    """Time `model`'s low-bit calls with 1..ROWS rows both ways, set pair_rows to match
    (`threshold`) and return it; None where nothing was timed (not VNNI, a small model). The
    environment's SPECSERVE_PAIR_ROWS, where set, is taken instead, and after the process's
    first timing, what it chose."""
    global _chosen
    want = os.environ.get(ENV)
    if want is not None:
        if not want.isdigit() or int(want) < 1:
            raise SpecserveError(f"{ENV}={want!r}: want a row count of 1 or more")
        return kernel_pair_rows(int(want))
    calls = [m for m in model.modules() if isinstance(m, LowbitCall)]
    size = sum(r.numel() * r.element_size() for c in calls for r in c.parts()[0])
    if kernel_isa() != "avx512vnni" or size < LEAST_BYTES:
        return None
    if _chosen is not None:
        return kernel_pair_rows(_chosen)
    rows = tuple(range(1, ROWS + 1))
    xs = {(m, k): torch.randn(m, k) for m in rows for k in {c.in_features for c in calls}}

    def run(m: int) -> None:  # every call once, as a forward reads them
        for c in calls:
            c.matmul(xs[(m, c.in_features)])

    with torch.inference_mode():
        seconds = time_pairs(run, (DEFAULT, 1), ROUNDS, rows)
    # each row count's median over the rounds of single / paired seconds, paired taken as 1
    ratios = [statistics.median(map(truediv, seconds[(DEFAULT, m)], seconds[(1, m)])) for m in rows]
    _chosen = kernel_pair_rows(threshold(ratios, [1.0] * len(rows)))
    return _chosen


def time_pairs(
    run: Callable[[int], None], starts: Sequence[int], rounds: int, rows: Sequence[int]
) -> dict[tuple[int, int], list[float]]:
    """The seconds of `run(m)` (m rows' worth of work) with pairs from each of `starts` rows,
    for every m in `rows`, one per round: each round takes the row counts in a shuffled order
    (seeded by the round) and each count's settings back to back, the first of them one
    further along each round, after one untimed round. Timed side by side, a round's ratios
    between settings leave out the VM's drift: timed apart, a slow stretch over one case
    made loading choose the walk that was 10-30 % slower (docs/perf/2026-12-01-xeon-pairs.md).
    The setting in force before is restored."""
    samples: dict[tuple[int, int], list[float]] = {(s, m): [] for s in starts for m in rows}
    was = kernel_pair_rows()
    try:
        for r in range(rounds + 1):
            order = list(rows)
            random.Random(r).shuffle(order)
            turn = r % len(starts)
            for m in order:
                for start in [*starts[turn:], *starts[:turn]]:
                    kernel_pair_rows(start)
                    t0 = time.perf_counter()
                    run(m)
                    if r:
                        samples[(start, m)].append(time.perf_counter() - t0)
    finally:
        kernel_pair_rows(was)
    return samples
