"""Plain-text tables and result files for the benchmarks."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

R = TypeVar("R")


@dataclass(frozen=True)
class Column:
    """One table column: the row key, its header, and a format for its values."""

    key: str
    header: str
    fmt: str = ""  # a format spec for the value, e.g. ".1f"; "" = str()


def format_table(rows: Sequence[dict[str, Any]], cols: Sequence[Column]) -> str:
    """Rows as a right-aligned table; a missing or None value prints as '-'."""
    cells = [[c.header for c in cols]]
    for r in rows:
        cells.append(["-" if r.get(c.key) is None else format(r[c.key], c.fmt) for c in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = [
        " | ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in cells
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def out_paths(out: Path) -> tuple[Path, Path]:
    """`--out results/serve` (or results/serve.json) -> results/serve.json, results/serve.png."""
    stem = out.with_suffix("") if out.suffix in (".json", ".png") else out
    stem.parent.mkdir(parents=True, exist_ok=True)
    return stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".png")


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def median_of(rows: Sequence[R], key: Callable[[R], float]) -> R:
    """The run with the median `key` (the lower middle one of an even count): a run that
    happened, not an average of several."""
    ranked = sorted(rows, key=key)
    return ranked[(len(ranked) - 1) // 2]


def interleaved(configs: Sequence[R], repeats: int) -> list[R]:
    """Every configuration once per round, odd rounds reversed: a slow spell of the machine
    lands on the configurations at both ends of the order alike, not on one of them."""
    return [c for r in range(repeats) for c in (configs if r % 2 == 0 else configs[::-1])]
