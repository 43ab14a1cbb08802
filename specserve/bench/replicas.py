"""`specserve bench serve --replicas 1 2 --sessions 16 --turns 4`: the sessions workload
(sessions.py) against Ray Serve clusters, affinity routing against Ray's default.

    specserve bench serve --replicas 1 2 --sessions 16 --turns 4 --slots 2 --threads 1

For each replica count N a fresh `specserve serve --replicas N` (a local Ray instance,
`--threads` per replica, `--slots` each) runs the same sessions; for N > 1 once with our
affinity router and once with Ray Serve's power of two choices (`--router pow2`), in
interleaved rounds. `--clients` (default: slots x the largest N) is the same for every row,
so rows differ only in the servers. The clients share one queue of sessions
(`--turn-order shared`): were each client to own its sessions, a client's next request would
go where its last one just freed a slot, and Ray's power of two choices would keep sessions
home by accident, not by knowing where their cache is. Reported per row: aggregate tok/s
(completion tokens of all turns over the run's wall time), mean time to first token on
turn 1 and on turns 2+, and the cached share of returning prompts. The issue's target:
affinity's turns-2+ TTFT <= 0.5x the default router's at the same N. `--share-outputs`
runs every cluster with it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specserve.bench.report import (
    Column,
    format_table,
    interleaved,
    median_of,
    out_paths,
    write_json,
)
from specserve.bench.server_process import ServerProcess, server_spec
from specserve.bench.session_load import Shape, run_sessions
from specserve.bench.sessions import SessionRow, summarise
from specserve.bench.workload import warm_up

TARGET_TTFT_RATIO = 0.5
COLUMNS = (
    Column("name", "replicas, router"),
    Column("requests", "requests"),
    Column("tok_s", "aggregate tok/s", ".1f"),
    Column("ttft_first_s", "TTFT turn 1 s", ".2f"),
    Column("ttft_later_s", "TTFT turns 2+ s", ".2f"),
    Column("ratio", "vs pow2", ".2f"),
    Column("cached_share", "cached share 2+", ".1%"),
    Column("errors", "errors"),
)


@dataclass
class ReplicaRow:
    name: str
    replicas: int
    router: str
    tok_s: float
    sessions: SessionRow

    def flat(self) -> dict[str, object]:
        row = {k: v for k, v in asdict(self.sessions).items() if k != "turns"}
        return row | {"name": self.name, "tok_s": self.tok_s}


def settings(counts: list[int]) -> list[tuple[str, int, str]]:
    """(row name, replicas, router): one router for one replica, both for more."""
    out = []
    for n in sorted(set(counts)):
        routers = ["affinity"] if n == 1 else ["affinity", "pow2"]
        out += [(f"{n} {r}", n, r) for r in routers]
    return out


def main(args: argparse.Namespace) -> None:
    slots = (args.slots or [2])[0]
    runs = settings(args.replicas)
    clients = args.clients or slots * max(args.replicas)
    turn_order = args.turn_order or "shared"
    shape = Shape(args.sessions, args.turns, clients, args.max_tokens, args.turn_words, turn_order)
    order = interleaved(runs, args.repeats)
    rows: dict[str, list[ReplicaRow]] = {}
    with tempfile.TemporaryDirectory(prefix="specserve-replicas-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        base = server_spec(args, slots, args.spec[0])
        for i, (name, n, router) in enumerate(order):
            spec = replace(
                base, replicas=n, router=router, share_outputs=args.share_outputs,
                cache_ram=args.cache_ram,
            )  # fmt: skip
            log = log_dir / f"server-replicas-{name.replace(' ', '-')}-{i}.log"
            with ServerProcess(spec, log) as srv:
                warm_up(srv.url)
                t0 = time.perf_counter()
                turns = run_sessions(srv.url, shape)
                wall = time.perf_counter() - t0
            tokens = sum(t.completion_tokens for t in turns)
            row = ReplicaRow(name, n, router, tokens / wall, summarise(name, turns, 0.0))
            rows.setdefault(name, []).append(row)
            print(
                f"{name}: {row.tok_s:.1f} tok/s, turns 2+ TTFT "
                f"{row.sessions.ttft_later_s or 0:.2f}s, {row.sessions.cached_share:.1%} cached",
                flush=True,
            )
    table = [_median(rs) for rs in rows.values()]
    ratios(table)
    print(
        f"{shape.sessions} sessions x {shape.turns} turns, -np {slots} a replica, {clients} "
        f"clients, turn order {shape.order}"
    )
    print(format_table([r.flat() for r in table], COLUMNS))
    print(verdict(table))
    if args.out:
        json_path, _ = out_paths(args.out)
        every = [
            r.flat() | {"turns": [asdict(t) for t in r.sessions.turns]}
            for rs in rows.values()
            for r in rs
        ]
        write_json(json_path, {"rows": every})
        print(f"wrote {json_path}")


def ratios(table: list[ReplicaRow]) -> None:
    """Each row's turns-2+ TTFT over the pow2 row's with as many replicas."""
    pow2 = {r.replicas: r.sessions.ttft_later_s for r in table if r.router == "pow2"}
    for r in table:
        base = pow2.get(r.replicas)
        if base and r.sessions.ttft_later_s is not None:
            r.sessions.ratio = r.sessions.ttft_later_s / base


def _median(rows: list[ReplicaRow]) -> ReplicaRow:
    return median_of(rows, lambda r: r.sessions.ttft_later_s or 0.0)


def verdict(table: list[ReplicaRow]) -> str:
    lines = []
    for r in table:
        if r.router == "affinity" and r.sessions.ratio is not None:
            ok = "meets" if r.sessions.ratio <= TARGET_TTFT_RATIO else "misses"
            lines.append(
                f"{r.replicas} replicas: affinity's turns 2+ TTFT is {r.sessions.ratio:.2f}x "
                f"pow2's ({ok} <= {TARGET_TTFT_RATIO}x)"
            )
    return "\n".join(lines) or "no affinity row with a pow2 row to compare"
