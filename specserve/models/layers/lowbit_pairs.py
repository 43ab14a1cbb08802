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
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from specserve.errors import SpecserveError
from specserve.models.layers.lowbit import LowbitCall, kernel_isa
from specserve.ops.cpu.build import load

# the row counts timed: a plain step's one row and a verification's few; from 4 rows up the
# kernels always pair (their default)
ROWS = 3
DEFAULT = ROWS + 1
# interleaved rounds timed after one that warms: a VM's speed drifts within seconds, and both
# walks of one row count are timed back to back in each round
ROUNDS = 3
# a model whose low-bit records are fewer bytes than this is not timed (tests' tiny models):
# its calls are too short to tell the walks apart
LEAST_BYTES = 64 << 20
ENV = "SPECSERVE_PAIR_ROWS"


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
    environment's SPECSERVE_PAIR_ROWS, where set, is taken instead."""
    want = os.environ.get(ENV)
    if want is not None:
        if not want.isdigit() or int(want) < 1:
            raise SpecserveError(f"{ENV}={want!r}: want a row count of 1 or more")
        return kernel_pair_rows(int(want))
    calls = [m for m in model.modules() if isinstance(m, LowbitCall)]
    size = sum(r.numel() * r.element_size() for c in calls for r in c.parts()[0])
    if kernel_isa() != "avx512vnni" or size < LEAST_BYTES:
        return None
    was = kernel_pair_rows()
    try:
        seconds = _time_walks(calls)
    finally:
        kernel_pair_rows(was)
    single = [statistics.median(seconds[(m, False)]) for m in range(1, ROWS + 1)]
    paired = [statistics.median(seconds[(m, True)]) for m in range(1, ROWS + 1)]
    return kernel_pair_rows(threshold(single, paired))


@torch.inference_mode()
def _time_walks(calls: list[LowbitCall]) -> dict[tuple[int, bool], list[float]]:
    """Seconds of every call once, per (rows, paired), over ROUNDS rounds after a warm one;
    the two walks alternate which goes first."""
    widths = {c.in_features for c in calls}
    xs = {(m, k): torch.randn(m, k) for m in range(1, ROWS + 1) for k in widths}
    seconds: dict[tuple[int, bool], list[float]] = {}
    for r in range(ROUNDS + 1):
        for m in range(1, ROWS + 1):
            for paired in (True, False) if r % 2 else (False, True):
                kernel_pair_rows(1 if paired else DEFAULT)
                t0 = time.perf_counter()
                for c in calls:
                    c.matmul(xs[(m, c.in_features)])
                if r:
                    seconds.setdefault((m, paired), []).append(time.perf_counter() - t0)
    return seconds
