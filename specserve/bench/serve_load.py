"""`specserve bench serve --load`: one server under steady load; errors and memory over time.

    specserve bench serve --load --clients 8 --duration 300 [--hostile 1]

One `specserve serve -np 4` subprocess, `--clients` closed-loop streaming clients for
`--duration` seconds (each also capped at `--requests-per-client` requests, so the run is
bounded in time and in count and stops by itself; a request started before the deadline
runs to its end). The server's RSS (VmRSS in /proc/PID/status) is sampled when the load
starts, every `--sample-every` seconds and at the end. Speculation is the first `--spec`
value (on: the server's default chain). Prompts repeat once the 16 in workload.py are used,
so the suffix speculator drafts repeats well: this mode is about errors and memory, the
throughput it prints is not the benchmark's.

`--hostile N` adds N clients that each send a random bad or extreme request every second
(bench/hostile.py); the normal clients' answers are then compared with a quiet pass over
the same prompts before the load (greedy: equal, token for token), and every bad request's
status with the ones its case allows (a 4xx or a correct answer, never a 5xx).

"Flat" (see `judge_flat`): the last sample is at most max(2 %, 32 MiB) above the first
sample taken under load. The sample at the start is not the baseline: before the first
requests the allocator pools, the tokenizer's caches and the suffix speculator's global
tree (bounded) have not reached their working size, and that one-off growth is not a leak.
A leak grows with work done, so it shows between the first loaded sample and the end.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specserve.bench.hostile import HostileRun, hostile_client
from specserve.bench.report import Column, format_table, out_paths, write_json
from specserve.bench.server_process import (
    MODEL_ID,
    InProcessServer,
    RssSampler,
    ServerProcess,
    launch,
    server_spec,
)
from specserve.bench.workload import (
    PROMPTS,
    Beside,
    RequestResult,
    RunResult,
    Workload,
    run_workload,
    warm_up,
)
from specserve.errors import SpecserveError

FLAT_FRACTION = 0.02  # allowed growth after the first loaded sample, relative ...
FLAT_MIB = 32.0  # ... or absolute (whichever is larger): allocator noise, not a leak
LOAD_REQUEST_CAP = 10_000  # per client: far above what 300 s allows, a bound all the same
RSS_COLUMNS = (
    Column("t_s", "t s", ".0f"),
    Column("requests", "requests done"),
    Column("rss_mib", "RSS MiB", ".1f"),
    Column("change_mib", "change MiB", "+.1f"),
)


@dataclass(frozen=True)
class Sample:
    """The server's RSS at `t_s` seconds into the load, after `requests` had finished."""

    t_s: float
    rss_mib: float
    requests: int


@dataclass(frozen=True)
class Flatness:
    """The verdict on an RSS series; `flat` is None when there are too few samples."""

    flat: bool | None
    growth_mib: float
    allowed_mib: float
    slope_mib_per_min: float
    reason: str


def judge_flat(samples: list[Sample]) -> Flatness:
    """Flat: the end is at most max(FLAT_FRACTION, FLAT_MIB) above the first loaded sample.

    samples[0] is taken when the load starts, samples[1] after the first interval; at least
    three samples are needed (start, first loaded, end). The slope (least squares over the
    loaded samples) is reported alongside, as the rate a leak would grow at.
    """
    if len(samples) < 3:
        return Flatness(None, 0.0, 0.0, 0.0, "too few samples: run longer than 2 intervals")
    base, end = samples[1], samples[-1]
    growth = end.rss_mib - base.rss_mib
    allowed = max(FLAT_FRACTION * base.rss_mib, FLAT_MIB)
    slope = _slope_per_min(samples[1:])
    flat = growth <= allowed
    reason = (
        f"end {end.rss_mib:.1f} MiB vs {base.rss_mib:.1f} MiB at {base.t_s:.0f}s "
        f"(first sample under load): {growth:+.1f} MiB, allowed {allowed:.1f} MiB "
        f"(max of {FLAT_FRACTION:.0%} and {FLAT_MIB:.0f} MiB); slope {slope:+.2f} MiB/min"
    )
    return Flatness(flat, growth, allowed, slope, reason)


def _slope_per_min(samples: list[Sample]) -> float:
    n = len(samples)
    mean_t = sum(s.t_s for s in samples) / n
    mean_r = sum(s.rss_mib for s in samples) / n
    var = sum((s.t_s - mean_t) ** 2 for s in samples)
    if var == 0:
        return 0.0
    cov = sum((s.t_s - mean_t) * (s.rss_mib - mean_r) for s in samples)
    return 60.0 * cov / var


def main(args: argparse.Namespace) -> None:
    """Run the load, print the RSS table and the verdicts, write --out files if asked."""
    slots = args.slots or [4]
    if len(slots) != 1:
        raise SpecserveError("--load runs one server: give one --slots value (default 4)")
    if args.duration <= 0 or args.sample_every <= 0:
        raise SpecserveError("--duration and --sample-every must be > 0")
    work = Workload(
        clients=args.clients or 8,
        requests_per_client=args.requests_per_client or LOAD_REQUEST_CAP,
        max_tokens=args.max_tokens,
        duration_s=args.duration,
    )
    sspec = server_spec(args, slots[0], args.spec[0])
    with tempfile.TemporaryDirectory(prefix="specserve-load-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        with launch(sspec, log_dir / "server-load.log", args.in_process) as server:
            warm_up(server.url)
            quiet = quiet_texts(server.url, work.max_tokens) if args.hostile else {}
            hostile = [_hostile(server.url, seed) for seed in range(args.hostile)]
            run, samples, bad = run_with_sampler(server, work, args.sample_every, hostile)
    print(f"server: -np {sspec.slots}, --spec-type {sspec.spec_type}; {work.clients} clients")
    print(format_table(rss_rows(samples), RSS_COLUMNS))
    flatness = judge_flat(samples)
    print(report(run, flatness))
    if args.hostile:
        print(hostile_report(run, quiet, bad))
    if args.out:
        json_path, png_path = out_paths(args.out)
        record = load_record(work, sspec.spec_type, run, samples, flatness)
        if args.hostile:
            record["hostile"] = hostile_record(run, quiet, bad)
        write_json(json_path, record)
        plot_rss(samples, png_path)
        print(f"wrote {json_path} and {png_path}")


def run_with_sampler(
    server: ServerProcess | InProcessServer,
    work: Workload,
    every: float,
    hostile: Sequence[Beside] = (),
) -> tuple[RunResult, list[Sample], list[HostileRun]]:
    """The clients' run, with the server's RSS sampled alongside it (and hostile clients
    sending beside the normal ones)."""
    finished: list[RequestResult] = []
    sampler = RssSampler(server.pid, every, progress=lambda: len(finished))
    sampler.start()
    try:
        run, hostile_runs = run_workload(server.url, work, out=finished, beside=hostile)
    finally:
        raw = sampler.stop()
    return run, [Sample(t, rss, n) for t, rss, n in raw], hostile_runs


def _hostile(url: str, seed: int) -> Beside:
    return lambda deadline: hostile_client(url, MODEL_ID, deadline, seed=seed)


def quiet_texts(url: str, max_tokens: int) -> dict[int, str]:
    """Each prompt's greedy answer with no hostile client about: prompt index -> text."""
    clients = 4
    work = Workload(clients, len(PROMPTS) // clients, max_tokens)
    run, _ = run_workload(url, work)
    failed = [r.error for r in run.requests if r.error]
    if failed:
        raise SpecserveError(f"the quiet pass failed: {failed[0]}")
    return {r.prompt: r.text for r in run.requests}


def hostile_record(
    run: RunResult, quiet: dict[int, str], hostile: list[HostileRun]
) -> dict[str, Any]:
    """The normal clients' texts against the quiet pass, and what the hostile ones got."""
    done = [r for r in run.requests if r.error is None]
    statuses = sum((h.statuses for h in hostile), Counter())
    return {
        "answers": len(done),
        "different": [r.prompt for r in done if r.text != quiet.get(r.prompt)],
        "errors": run.errors,
        "sent": sum(h.sent for h in hostile),
        "statuses": {str(s): n for s, n in sorted(statuses.items())},
        "wrong": [w for h in hostile for w in h.wrong],
    }


def hostile_report(run: RunResult, quiet: dict[int, str], hostile: list[HostileRun]) -> str:
    """hostile_record in words: one line for the normal clients, one for the hostile."""
    r = hostile_record(run, quiet, hostile)
    lines = [
        f"normal clients: {r['answers'] - len(r['different'])} of {r['answers']} answers equal "
        f"to the quiet pass's (target all), {r['errors']} errors (target 0)",
        f"hostile clients: {r['sent']} bad requests, statuses "
        + ", ".join(f"{s}: {n}" for s, n in r["statuses"].items())
        + f"; {len(r['wrong'])} answered outside their allowed statuses (target 0)",
    ]
    if r["different"]:
        lines.append(f"first different answer: prompt {r['different'][0]}")
    if r["wrong"]:
        lines.append(f"first wrong answers: {r['wrong'][:5]}")
    return "\n".join(lines)


def rss_rows(samples: list[Sample]) -> list[dict[str, float | int]]:
    first = samples[0].rss_mib
    return [{**asdict(s), "change_mib": s.rss_mib - first} for s in samples]


def report(run: RunResult, flatness: Flatness) -> str:
    """Requests, tokens, errors (target 0) and the RSS verdict, one line each."""
    tok_s = run.tokens / run.wall_s if run.wall_s > 0 else 0.0
    verdict = {True: "flat", False: "NOT flat", None: "not judged"}[flatness.flat]
    lines = [
        f"requests: {len(run.requests)}, tokens: {run.tokens} in {run.wall_s:.1f}s "
        f"({tok_s:.1f} tok/s aggregate)",
        f"errors: {run.errors} (target 0)",
        f"RSS: {verdict}: {flatness.reason}",
    ]
    errors = [r.error for r in run.requests if r.error]
    if errors:
        lines.append(f"first error: {errors[0]}")
    return "\n".join(lines)


def load_record(
    work: Workload, spec_type: str, run: RunResult, samples: list[Sample], flatness: Flatness
) -> dict[str, object]:
    return {
        "workload": asdict(work),
        "spec_type": spec_type,
        "requests": len(run.requests),
        "tokens": run.tokens,
        "wall_s": run.wall_s,
        "errors": run.errors,
        "error_messages": sorted({r.error for r in run.requests if r.error}),
        "samples": [asdict(s) for s in samples],
        "flatness": asdict(flatness),
    }


def plot_rss(samples: list[Sample], path: Path) -> None:
    """RSS against time, with the band `judge_flat` allows above the first loaded sample."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s.t_s for s in samples], [s.rss_mib for s in samples], marker="o", label="RSS")
    if len(samples) >= 3:
        base = samples[1].rss_mib
        top = base + max(FLAT_FRACTION * base, FLAT_MIB)
        ax.axhspan(base, top, color="green", alpha=0.15, label="allowed growth ('flat')")
    ax.set_xlabel("seconds under load")
    ax.set_ylabel("server RSS (MiB)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle("specserve serve under load: resident memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
