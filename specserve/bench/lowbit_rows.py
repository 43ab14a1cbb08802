"""`bench decode --by-kind`: where a verify row's cost sits among a model's low-bit calls;
`--pair-rows`: what a forward of a few rows costs as the VNNI walk pairs tiles from more or
fewer rows (models/layers/lowbit_pairs.py).

The calls (`LowbitCall`: one matrix, or q/k/v and gate/up fused) are grouped by shape and
kinds, and each group is timed with 1, 2, 3, 4 and 8 rows of x in interleaved rounds. A
group's calls run back to back, each matrix once, as a forward reads them, so its records
come from memory as in decoding. On a CPU whose one-row decode is near its instructions'
limit, a second row costs some kinds far more than others: the 0.5B's K-quant down
projections held 29 % of its layers' bytes and 59 % of what a second row added
(docs/perf/2026-11-30-row-cost-by-kind.md).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn

from specserve.bench.report import Column, format_table, interleaved
from specserve.models.layers.lowbit import LowbitCall
from specserve.ops.naive.lowbit import Q4, Q4K, Q5, Q6, Q6K, Q8

ROWS = (1, 2, 3, 4, 8)
KIND_NAMES = {Q8: "q8", Q4: "q4", Q5: "q5", Q6: "q6", Q4K: "q4k", Q6K: "q6k"}
# a group: (in_features, out_features, each part's kind)
Group = tuple[int, int, tuple[int, ...]]


def call_groups(model: nn.Module) -> dict[Group, list[LowbitCall]]:
    """The model's low-bit calls by shape and kinds, in the order the model holds them."""
    groups: dict[Group, list[LowbitCall]] = {}
    for m in model.modules():
        if isinstance(m, LowbitCall):
            key = (m.in_features, m.out_features, tuple(m.parts()[1]))
            groups.setdefault(key, []).append(m)
    return groups


@torch.inference_mode()
def time_groups(
    groups: dict[Group, list[LowbitCall]], rounds: int, rows: tuple[int, ...] = ROWS
) -> dict[tuple[Group, int], float]:
    """The median seconds of each group's calls with each row count over `rounds` rounds
    (every row count once a round, odd rounds reversed, after one untimed round)."""
    width = max((k for k, _, _ in groups), default=0)
    xs = {m: torch.randn(m, width) for m in rows}
    samples: dict[tuple[Group, int], list[float]] = defaultdict(list)
    for i, m in enumerate(interleaved(list(rows), rounds + 1)):
        for key, calls in groups.items():
            x = xs[m][:, : key[0]].contiguous()
            t0 = time.perf_counter()
            for call in calls:
                call.matmul(x)
            if i >= len(rows):  # the first round only warms up
                samples[(key, m)].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def kinds_table(
    groups: dict[Group, list[LowbitCall]],
    times: dict[tuple[Group, int], float],
    rows: tuple[int, ...] = ROWS,
) -> str:
    """ms per forward of each group and of all of them at each row count, and each row
    count over one row."""
    table = [
        _row(len(calls), key, rows, [times[(key, m)] for m in rows])
        for key, calls in groups.items()
    ]
    total = [sum(times[(key, m)] for key in groups) for m in rows]
    table.append(_row(sum(len(c) for c in groups.values()), None, rows, total))
    cols = [Column("calls", "calls"), Column("shape", "K x N"), Column("kinds", "kinds")]
    cols += [Column(f"ms{m}", f"{m} row{'s' * (m > 1)} ms", ".3f") for m in rows]
    cols += [Column(f"x{m}", f"{m} / 1", ".2f") for m in rows[1:]]
    return format_table(table, cols)


def _row(
    calls: int, key: Group | None, rows: tuple[int, ...], seconds: list[float]
) -> dict[str, object]:
    """One table row: a group's (key None: all groups') seconds at each row count."""
    row: dict[str, object] = {"calls": calls, "shape": "all", "kinds": ""}
    if key is not None:
        row["shape"] = f"{key[0]} x {key[1]}"
        row["kinds"] = "+".join(KIND_NAMES.get(k, str(k)) for k in key[2])
    for m, s in zip(rows, seconds, strict=True):
        row[f"ms{m}"] = s * 1e3
        row[f"x{m}"] = s / seconds[0] if seconds[0] > 0 else None
    return row


def pairs_table(
    times: dict[tuple[int, int], float], starts: Sequence[int], rows: tuple[int, ...] = ROWS
) -> str:
    """Per pair_rows setting in `starts`, a forward of each row count over one row at the
    first of them."""
    one = times[(starts[0], rows[0])]
    table = [
        {"from": start, **{f"x{m}": times[(start, m)] / one for m in rows}} for start in starts
    ]
    cols = [Column("from", "pairs from")]
    cols += [Column(f"x{m}", f"{m} row{'s' * (m > 1)}", ".3f") for m in rows]
    return f"one row at pairs from {starts[0]}: {one * 1e3:.2f} ms\n" + format_table(table, cols)
