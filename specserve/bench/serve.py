"""Benchmark: the server's aggregate throughput with 1, 2 and 4 slots, speculation on and off.

    specserve bench serve                                  # slots 1 2 4 x speculation on, off
    specserve bench serve --out results/serve              # + results/serve.json, .png
    specserve bench serve --load --clients 8 --duration 300   # errors and RSS under load
    specserve bench serve --sessions 16 --turns 4          # the prompt store on vs off
    specserve bench serve --sessions 16 --replicas 1 2     # Ray Serve: affinity vs default

For each configuration a fresh `specserve serve` subprocess (so the speculators start
empty) gets one unmeasured warm-up request, then `--clients` concurrent OpenAI streaming
clients each send `--requests-per-client` greedy chat requests for code (workload.py).
Aggregate tok/s = generated tokens of all requests / wall time from the first send to the
last token. Speedup is against the 1-slot row with the same speculation setting: it says
how much of the extra parallel work the batched forward absorbs (the target is >= 2.5x at
4 slots). Time to first token includes the wait for a slot, so it grows when slots are
fewer than clients. `--load` is in serve_load.py.

Each configuration runs `--repeats` times, in rounds that visit every configuration once,
every other round in reverse order, and the table shows each one's median (and its range).
Why: on the shared 2-core VMs this was built on, the same 4-row step took far longer a few
minutes later (figures: docs/perf/bench.md), so one pass of 1 slot, then 4 slots, measured
the machine's drift as much as the slots; interleaved rounds give drift to every
configuration alike, and the median drops a run that caught a slow spell.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specserve.bench.args import positive
from specserve.bench.report import (
    Column,
    format_table,
    interleaved,
    median_of,
    out_paths,
    write_json,
)
from specserve.bench.server_process import ServerSpec, launch, server_spec
from specserve.bench.workload import RunResult, Workload, run_workload, warm_up
from specserve.models.layers.quant import WEIGHT_MODES
from specserve.server.cli_args import DEFAULT_SPEC

TARGET_SPEEDUP = 2.5  # aggregate tok/s at 4 slots over 1 slot
COLUMNS = (
    Column("slots", "slots"),
    Column("spec", "spec"),
    Column("requests", "requests"),
    Column("tokens", "total tokens"),
    Column("wall_s", "wall s", ".1f"),
    Column("tok_s", "aggregate tok/s", ".1f"),
    Column("tok_s_range", "range"),
    Column("speedup", "speedup vs 1 slot", ".2f"),
    Column("ttft_s", "mean TTFT s", ".2f"),
    Column("errors", "errors"),
)


@dataclass
class Row:
    """One configuration's result: a table row and a JSON record."""

    slots: int
    spec: str  # "on" or "off"
    spec_type: str
    requests: int
    tokens: int
    wall_s: float
    tok_s: float
    ttft_s: float | None
    errors: int
    speedup: float | None = None  # set once the same spec's smallest-slot row is known
    first_error: str | None = None
    runs: int = 1  # measured runs this row is the median of
    tok_s_range: str | None = None  # "min-max" of the runs' tok/s, when more than one


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="a name, .gguf or HF folder")
    p.add_argument("--dtype", default="float32", choices=["float64", "float32", "bfloat16"])
    p.add_argument(
        "--weights",
        default="auto",
        choices=WEIGHT_MODES,
        help="the servers' --weights (default auto, as `specserve serve`; dequant: float weights)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: the server's choice)")
    p.add_argument("--ctx-size", type=int, default=0, help="context per slot (server default)")
    p.add_argument(
        "--threads", type=int, default=0, help="the server's OMP_NUM_THREADS (0 = default)"
    )
    p.add_argument(
        "--clients", type=positive, default=None, help="concurrent clients (4; --load 8)"
    )
    p.add_argument("--max-tokens", type=positive, default=128, help="tokens per request (128)")
    p.add_argument(
        "--requests-per-client",
        type=positive,
        default=None,
        help="requests each client sends (4; with --load a cap besides --duration: 10000)",
    )
    p.add_argument(
        "--slots", type=int, nargs="+", default=None, help="-np values (1 2 4; --load: 4)"
    )
    p.add_argument(
        "--spec",
        nargs="+",
        choices=["on", "off"],
        default=["on", "off"],
        help="speculation settings to run (both; --load runs the first)",
    )
    p.add_argument("--spec-type", default=DEFAULT_SPEC, help=f"the chain for 'on' ({DEFAULT_SPEC})")
    p.add_argument(
        "--repeats",
        type=positive,
        default=3,
        help="runs per configuration, in interleaved rounds; the table shows medians (3)",
    )
    p.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.png")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs here")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run each server in a thread of this process (quick start, for tests); the "
        "default subprocess keeps the clients off the engine's GIL and its RSS its own",
    )
    sessions = p.add_argument_group("sessions mode (bench/sessions.py): the prompt store")
    sessions.add_argument(
        "--sessions", type=positive, default=None, help="agent-like sessions, store on vs off"
    )
    sessions.add_argument("--turns", type=positive, default=4, help="turns per session (4)")
    sessions.add_argument(
        "--turn-words",
        type=positive,
        default=80,
        help="words of a later turn's tool output; the first turn's task has 6x (80)",
    )
    sessions.add_argument(
        "--turn-order",
        choices=["client", "shared"],
        default=None,
        help="client: each client owns its sessions (default); shared: clients take turns "
        "from one queue, so a session's turns hop clients (default with --replicas)",
    )
    sessions.add_argument(
        "--cache-ram", type=float, default=None, help="the store-on server's --cache-ram MiB"
    )
    sessions.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        metavar="BIN",
        help="also run llama.cpp's llama-server (built by ../shared/tools/build-llama-cpp) on "
        "the same GGUF, with its --cache-ram on (the same MiB, else its 8192) and 0",
    )
    sessions.add_argument(
        "--replicas",
        type=positive,
        nargs="+",
        default=None,
        help="run the sessions on `serve --replicas N` clusters (Ray Serve), affinity "
        "routing vs Ray's default for N > 1 (bench/replicas.py)",
    )
    sessions.add_argument(
        "--share-outputs", action="store_true", help="with --replicas: the clusters share outputs"
    )
    load = p.add_argument_group("load mode")
    load.add_argument("--load", action="store_true", help="errors and RSS under steady load")
    load.add_argument("--duration", type=float, default=300.0, help="seconds of load (300)")
    load.add_argument(
        "--sample-every", type=float, default=30.0, help="seconds between RSS samples (30)"
    )
    load.add_argument(
        "--hostile",
        type=int,
        default=0,
        help="clients that each send a random bad or extreme request every second "
        "(bench/hostile.py) beside the normal ones, whose texts are then checked against "
        "a quiet pass over the same prompts (default 0)",
    )


def main(args: argparse.Namespace) -> None:
    """`specserve bench serve`: the throughput table, or with --load the load report."""
    if args.load:
        from specserve.bench import serve_load

        serve_load.main(args)
        return
    if args.sessions and args.replicas:
        from specserve.bench import replicas

        replicas.main(args)
        return
    if args.sessions:
        from specserve.bench import sessions

        sessions.main(args)
        return
    work = Workload(
        clients=args.clients or 4,
        requests_per_client=args.requests_per_client or 4,
        max_tokens=args.max_tokens,
    )
    with tempfile.TemporaryDirectory(prefix="specserve-bench-") as tmp:
        runs = run_matrix(args, work, args.log_dir or Path(tmp))
    rows = medians(runs)
    print(format_table([asdict(r) for r in rows], COLUMNS))
    print(summary(rows))
    if args.out:
        json_path, png_path = out_paths(args.out)
        record = {"workload": asdict(work), "rows": [asdict(r) for r in rows]}
        write_json(json_path, record | {"runs": [asdict(r) for r in runs]})
        plot(rows, png_path)
        print(f"wrote {json_path} and {png_path}")


def run_order(specs: list[str], slots: list[int], repeats: int) -> list[tuple[str, int]]:
    """Every (spec, slots) once per round, in interleaved rounds (report.interleaved)."""
    return interleaved([(spec, n) for spec in specs for n in sorted(slots)], repeats)


def run_matrix(args: argparse.Namespace, work: Workload, log_dir: Path) -> list[Row]:
    """One fresh server per run; prints a line as each is measured. -> one Row per run."""
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[Row] = []
    for i, (spec, slots) in enumerate(run_order(args.spec, args.slots or [1, 2, 4], args.repeats)):
        sspec = server_spec(args, slots, spec)
        log = log_dir / f"server-np{slots}-spec-{spec}-{i}.log"
        with launch(sspec, log, args.in_process) as server:
            warm_up(server.url)
            run, _ = run_workload(server.url, work)
        r = make_row(sspec, spec, run)
        runs.append(r)
        print(
            f"np={slots} spec {spec}: {r.tokens} tokens in {r.wall_s:.1f}s "
            f"({r.tok_s:.1f} tok/s), {r.errors} errors",
            flush=True,
        )
    return runs


def medians(runs: list[Row]) -> list[Row]:
    """One row per (spec, slots), in first-run order: the run with the median tok/s (the
    lower middle one of an even count), errors of all runs added up, speedups set."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in runs:
        groups.setdefault((r.spec, r.slots), []).append(r)
    rows = []
    for same in groups.values():
        ranked = sorted(same, key=lambda r: r.tok_s)
        mid = replace(median_of(same, lambda r: r.tok_s), runs=len(same))
        mid.errors = sum(r.errors for r in same)
        mid.first_error = next((r.first_error for r in same if r.first_error), None)
        if len(same) > 1:
            mid.tok_s_range = f"{ranked[0].tok_s:.1f}-{ranked[-1].tok_s:.1f}"
        rows.append(mid)
    set_speedups(rows)
    return rows


def make_row(sspec: ServerSpec, spec: str, run: RunResult) -> Row:
    """Summarise one run: totals, aggregate tok/s, mean TTFT over requests that got a token."""
    ttfts = [r.ttft_s for r in run.requests if r.ttft_s is not None]
    first_error = next((r.error for r in run.requests if r.error), None)
    return Row(
        slots=sspec.slots,
        spec=spec,
        spec_type=sspec.spec_type,
        requests=len(run.requests),
        tokens=run.tokens,
        wall_s=run.wall_s,
        tok_s=run.tokens / run.wall_s if run.wall_s > 0 else 0.0,
        ttft_s=sum(ttfts) / len(ttfts) if ttfts else None,
        errors=run.errors,
        first_error=first_error,
    )


def set_speedups(rows: list[Row]) -> None:
    """Each row's tok/s over that of the same spec's row with the fewest slots."""
    for row in rows:
        same = [r for r in rows if r.spec == row.spec]
        base = min(same, key=lambda r: r.slots)
        row.speedup = row.tok_s / base.tok_s if base.tok_s > 0 else None


def summary(rows: list[Row]) -> str:
    """What the table means for the target, and the first error of any failing row."""
    lines = []
    for spec in dict.fromkeys(r.spec for r in rows):
        same = [r for r in rows if r.spec == spec]
        lo, hi = min(same, key=lambda r: r.slots), max(same, key=lambda r: r.slots)
        if hi.slots > lo.slots and hi.speedup is not None:
            verdict = "meets" if hi.speedup >= TARGET_SPEEDUP else "misses"
            lines.append(
                f"spec {spec}: {hi.slots} slots give {hi.speedup:.2f}x the aggregate tok/s of "
                f"{lo.slots} ({verdict} the {TARGET_SPEEDUP}x target)"
            )
    for r in rows:
        if r.first_error:
            lines.append(f"np={r.slots} spec {r.spec}: {r.errors} errors, first: {r.first_error}")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Aggregate tok/s and mean TTFT against slots, one line per speculation setting."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for spec in dict.fromkeys(r.spec for r in rows):
        same = sorted((r for r in rows if r.spec == spec), key=lambda r: r.slots)
        slots = [r.slots for r in same]
        ax_tps.plot(slots, [r.tok_s for r in same], marker="o", label=f"speculation {spec}")
        ttft = [r.ttft_s if r.ttft_s is not None else float("nan") for r in same]
        ax_ttft.plot(slots, ttft, marker="o", label=f"speculation {spec}")
    for ax, label in ((ax_tps, "aggregate tok/s"), (ax_ttft, "mean time to first token (s)")):
        ax.set_xlabel("parallel slots (-np)")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r.slots for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("specserve serve: concurrent streaming clients")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
