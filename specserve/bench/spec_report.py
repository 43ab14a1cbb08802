"""`specserve bench spec`'s results: a run, the table's rows and columns, the files."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve.bench.report import Column, write_json
from specserve.errors import SpecserveError

if TYPE_CHECKING:
    from specserve.speculative.base import Speculator
    from specserve.speculative.ledger import Mark

NONE = "none"
# `shared:CHAIN`: CHAIN whose speculators first learn the reference's output, as a replica
# told of another replica's answer to the same request (--share-outputs) would have
SHARED = "shared:"

COLUMNS = (
    Column("model", "model"),
    Column("workload", "workload"),
    Column("config", "config"),
    Column("tokens", "tokens"),
    Column("tok_s", "tok/s", ".2f"),
    Column("speedup", "speedup", ".2f"),
    Column("accept", "accept", ".2f"),
    Column("mean_acc", "mean acc", ".2f"),
    Column("same_text", "same"),
    Column("hist", "accepted lengths (n:drafts)"),
)


@dataclass
class Run:
    """One generation: its tokens, decode speed and the speculator's statistics."""

    tokens: list[int]
    tok_s: float
    seconds: float
    stats: dict[str, Any] | None
    ledgers: str = ""  # what each costly drafter's asks saved (ledger.py)
    drafters: str = ""  # a chain's drafts, child by child (`drafters`)
    threads: str = ""  # its forwards on fewer threads than all cores (`fewer_threads`)
    branches: tuple[int, int] = (0, 0)  # alternatives verified, and kept (verify.py)

    @property
    def drafts(self) -> int:
        return int((self.stats or {}).get("drafts_generated", 0))


def histogram(counts: list[int]) -> str:
    """Drafts per accepted length, in power-of-two buckets past 2 (a compact table cell):
    histogram([5, 2, 0, 1, 0, 3]) == '0:5 1:2 3-4:1 5-8:3'."""
    buckets: dict[str, int] = {}
    for n, c in enumerate(counts):
        if c:
            lo = 1 << ((n - 1).bit_length() - 1) if n > 2 else 0  # 3-4, 5-8, 9-16, ...
            label = f"{lo + 1}-{2 * lo}" if lo else str(n)
            buckets[label] = buckets.get(label, 0) + c
    return " ".join(f"{k}:{v}" for k, v in buckets.items()) or "-"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def paired(runs: Sequence[Run], base: Sequence[Run]) -> list[float]:
    """Each round's tok/s over the base configuration's in the same round."""
    if len(runs) != len(base):
        raise ValueError(f"{len(runs)} rounds against {len(base)}: rounds pair one to one")
    return [r.tok_s / b.tok_s if b.tok_s else 0.0 for r, b in zip(runs, base, strict=True)]


def make_row(
    model: str,
    workload: str,
    config: str,
    runs: list[Run],
    ref: Run,
    plain: list[Run],
    versus: list[Run] | None = None,
) -> dict[str, Any]:
    """One table row from a configuration's rounds: the median speed, the median of its
    per-round ratios to `plain` (`none`) and to `versus`; statistics of the first run;
    `same` only if every run's tokens equal the reference's."""
    run = runs[0]
    s = run.stats or {}
    drafts = run.drafts
    diffs = [first_difference(r.tokens, ref.tokens) for r in runs]
    diff = next((d for d in diffs if d is not None), None)
    speedups = paired(runs, plain)
    ratios = paired(runs, versus) if versus is not None else None
    return {
        "model": model,
        "workload": workload,
        "config": config,
        "tokens": len(run.tokens),
        "tok_s": statistics.median(r.tok_s for r in runs),
        "tok_s_runs": [r.tok_s for r in runs],
        "speedup": statistics.median(speedups),
        "speedup_runs": speedups,
        "versus": statistics.median(ratios) if ratios else None,
        "versus_runs": ratios,
        # None (printed '-') where nothing was drafted
        "accept": s["acceptance_rate"] if drafts else None,
        "mean_acc": s["tokens_accepted"] / drafts if drafts else None,
        "hist": histogram(list(s.get("accept_len_hist", []))),
        "same": diff is None,
        "same_text": "yes" if diff is None else f"NO@{diff}",
        "first_diff": diff,
        "drafts": drafts,
        "drafted_tokens": int(s.get("tokens_generated", 0)),
        "draft_seconds": float(s.get("draft_seconds", 0.0)),
        "seconds": run.seconds,
    }


def write_outputs(rows: list[dict[str, Any]], out: Path, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings.pop("func", None)
    write_json(out / "spec.json", {"settings": settings, "rows": rows})
    plot(rows, out / "spec.png")
    print(f"wrote {out / 'spec.json'} and {out / 'spec.png'}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per model: speedup over no speculation, bars per config, grouped by workload."""
    try:
        import matplotlib
    except ImportError as e:
        raise SpecserveError("the plot needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")  # files only; no display
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 1, figsize=(12, 4 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=True):
        mine = [r for r in rows if r["model"] == model and r["config"] != NONE]
        workloads = list(dict.fromkeys(r["workload"] for r in mine))
        configs = list(dict.fromkeys(r["config"] for r in mine))
        width = 0.8 / max(len(configs), 1)
        for i, config in enumerate(configs):
            by_w = {r["workload"]: r["speedup"] for r in mine if r["config"] == config}
            xs = [w + i * width - 0.4 + width / 2 for w in range(len(workloads))]
            ax.bar(xs, [by_w.get(w, 0.0) for w in workloads], width, label=config)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("speedup vs no spec")
        ax.set_title(model)
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ledgers(spec: Speculator | None, since: Mapping[str, Mark] | None = None) -> str:
    """Each costly drafter's ledger (speculative/ledger.py), a chain's children's too;
    `since`: their asks after these marks (by drafter name) alone."""
    costly = [c for c in members(spec) if c.relative_cost > 0]
    marks = since or {}
    return "; ".join(f"{c.name}: {c.worth.ledger.summary(marks.get(c.name))}" for c in costly)


def members(spec: Speculator | None) -> list[Speculator]:
    """A chain's children, a lone speculator itself, or none."""
    from specserve.speculative.chain import ChainSpeculator

    return spec.children if isinstance(spec, ChainSpeculator) else [spec] if spec else []


def drafters(spec: Speculator | None) -> str:
    """A chain's children's verified drafts, those of which nothing was kept, the tokens
    kept and the time spent drafting: whose drafts a run's misses were, and what asking
    each cost (a lone speculator's are the run's own)."""
    from specserve.speculative.chain import ChainSpeculator

    if not isinstance(spec, ChainSpeculator):
        return ""
    parts = []
    for child in spec.children:
        s = child.stats
        missed = s.drafts_generated - s.drafts_accepted  # nothing kept
        parts.append(
            f"{child.name} {s.drafts_generated} drafts, {missed} missed, "
            f"{s.tokens_accepted} kept, {1000 * s.draft_seconds:.0f} ms"
        )
    return "; ".join(parts)


def progress_line(model: str, workload: str, config: str, run: Run, timed: bool = True) -> str:
    offered, kept = run.branches
    return (
        f"[{model} {workload} {config}] {len(run.tokens)} tokens, {run.tok_s:.2f} tok/s, "
        f"{run.drafts} drafts"
        + (f" ({run.drafters})" if run.drafters else "")
        + ("" if timed else " (warm-up, not counted)")
        + (f" [{run.ledgers}]" if run.ledgers else "")
        + (f" ({run.threads})" if run.threads else "")
        + (f" (alternatives kept: {kept} of {offered})" if offered else "")
    )


def fewer_threads(ran: Mapping[int, int], top: int) -> str:
    """How many of a run's `ran` forwards (per thread count) went on fewer than `top`
    threads, e.g. '12 of 150 forwards on 1 thread'; '' when none did. A run whose steps the
    thread tuner kept on one core is slower for a reason no drafter explains."""
    total = sum(ran.values())
    fewer = [(t, n) for t, n in sorted(ran.items()) if t < top and n]
    return ", ".join(f"{n} of {total} forwards on {t} thread{'s' * (t > 1)}" for t, n in fewer)
