"""`specserve bench serve --sessions N --turns T`: agent-like sessions, the prompt store on
and off.

    specserve bench serve --sessions 16 --turns 4 --slots 4 [--cache-ram MB] [--repeats 1]

N sessions (bench/session_load.py), interleaved over `--clients` concurrent clients
(default: the slot count): client c runs sessions c, c + clients, ... one turn of each in
turn, so far more conversations are live than there are slots. Shaped like a coding
agent's: every session shares one long system prompt (tool descriptions), its first user
message is the task with its context (6x `--turn-words` words of code-like text), and each
later turn adds a short tool output (`--turn-words`, default 80 words), re-sending the whole
history with the greedy answers of `--max-tokens` in it: about 1.5k tokens at turn 1, 2-3k
by turn 4 on the 0.5B's tokenizer. The same workload runs against a server with the prompt
store (`--cache-ram`, default the server's) and one with `--cache-ram 0`, in interleaved
rounds.
Reported per setting: mean time to first token on turn 1 and on turns 2+, the share of
returning prompts (turns 2+) that `usage.cached_tokens` covers (their sum, and the least of
any one prompt), the server's peak RSS (VmHWM) and the store's bytes and budget. The issue's
targets: TTFT on turns 2+ with the store <= 0.25x of it without; >= 90 % of each returning
prompt cached.

With `--llama-server BIN` the same sessions also run against llama.cpp's llama-server on the
same GGUF, with its RAM prompt cache (`--cache-ram`, the same MiB) and with it off; each
server's ratio is against itself with its cache off.
"""

from __future__ import annotations

import argparse
import tempfile
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specserve.bench.report import (
    Column,
    format_table,
    interleaved,
    median_of,
    out_paths,
    write_json,
)
from specserve.bench.server_process import launch, read_rss_mib, server_spec
from specserve.bench.session_load import Shape, Turn, run_sessions
from specserve.bench.workload import warm_up
from specserve.errors import SpecserveError

PEER = "llama.cpp"
PEER_CTX_PER_SLOT = 8192  # context per llama-server slot: the longest session with room
PEER_DEFAULT_CACHE_MIB = 8192.0  # llama-server's own --cache-ram default
TARGET_TTFT_RATIO = 0.25
TARGET_CACHED_SHARE = 0.9
COLUMNS = (
    Column("store", "store"),
    Column("requests", "requests"),
    Column("ttft_first_s", "TTFT turn 1 s", ".2f"),
    Column("ttft_later_s", "TTFT turns 2+ s", ".2f"),
    Column("ratio", "vs store off", ".2f"),
    Column("cached_share", "cached share 2+", ".1%"),
    Column("cached_min", "least cached", ".1%"),
    Column("prompt_tokens_last", "prompt tok last turn"),
    Column("peak_rss_mib", "peak RSS MiB", ".0f"),
    Column("store_mib", "store MiB", ".0f"),
    Column("budget_mib", "budget MiB", ".0f"),
    Column("errors", "errors"),
)


@dataclass
class SessionRow:
    store: str  # "on" or "off"
    requests: int
    ttft_first_s: float | None
    ttft_later_s: float | None
    cached_share: float
    cached_min: float
    prompt_tokens_last: int
    peak_rss_mib: float
    errors: int
    ratio: float | None = None  # ttft_later_s over the store-off row's
    store_mib: float = 0.0  # what the store held at the end
    budget_mib: float = 0.0  # its budget (--cache-ram)
    turns: list[Turn] = field(default_factory=list)


def store_bytes(url: str) -> tuple[float, float]:
    """(bytes held, budget) of the server's prompt store, from its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as page:
        text = page.read().decode()
    values = {}
    for line in text.splitlines():
        for key in ("prompt_store_bytes", "prompt_store_budget_bytes"):
            if line.startswith(f"specserve:{key}{{"):
                values[key] = float(line.rsplit(" ", 1)[1])
    return values.get("prompt_store_bytes", 0.0), values.get("prompt_store_budget_bytes", 0.0)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarise(store: str, turns: list[Turn], peak_rss_mib: float) -> SessionRow:
    ok = [t for t in turns if t.error is None]
    later = [t for t in ok if t.turn > 1]
    shares = [t.cached_tokens / t.prompt_tokens for t in later if t.prompt_tokens]
    prompt_later = sum(t.prompt_tokens for t in later)
    last = max((t.turn for t in ok), default=0)
    return SessionRow(
        store=store,
        requests=len(turns),
        ttft_first_s=_mean([t.ttft_s for t in ok if t.turn == 1 and t.ttft_s is not None]),
        ttft_later_s=_mean([t.ttft_s for t in later if t.ttft_s is not None]),
        cached_share=sum(t.cached_tokens for t in later) / prompt_later if prompt_later else 0.0,
        cached_min=min(shares, default=0.0),
        prompt_tokens_last=max((t.prompt_tokens for t in ok if t.turn == last), default=0),
        peak_rss_mib=peak_rss_mib,
        errors=len(turns) - len(ok),
        turns=turns,
    )


def main(args: argparse.Namespace) -> None:
    slots = (args.slots or [4])[0]
    turn_order = args.turn_order or "client"
    shape = Shape(
        args.sessions,
        args.turns,
        args.clients or slots,
        args.max_tokens,
        args.turn_words,
        turn_order,
    )
    settings: list[tuple[str, float | None]] = [("on", args.cache_ram), ("off", 0.0)]
    if args.llama_server is not None:
        _peer_gguf(args)  # a bad --llama-server or model fails now, not after our rows
        settings += [(f"{PEER} on", args.cache_ram), (f"{PEER} off", 0.0)]
    order = interleaved(settings, args.repeats)
    rows: dict[str, list[SessionRow]] = {}
    with tempfile.TemporaryDirectory(prefix="specserve-sessions-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for i, (name, mb) in enumerate(order):
            log = log_dir / f"server-sessions-{name.replace(' ', '-')}-{i}.log"
            if name.startswith(PEER):
                row = _peer_row(name, mb, args, slots, shape, log)
            else:
                sspec = replace(server_spec(args, slots, args.spec[0]), cache_ram=mb)
                with launch(sspec, log, args.in_process) as srv:
                    warm_up(srv.url)
                    turns = run_sessions(srv.url, shape)
                    peak = read_rss_mib(srv.pid, "VmHWM")
                    held, budget = store_bytes(srv.url)
                row = summarise(name, turns, peak)
                row.store_mib, row.budget_mib = held / 2**20, budget / 2**20
            rows.setdefault(name, []).append(row)
            print(
                f"store {name}: turns 2+ mean TTFT {row.ttft_later_s or 0:.2f}s, "
                f"{row.cached_share:.1%} cached, peak RSS {row.peak_rss_mib:.0f} MiB",
                flush=True,
            )
    table = [_median(rs) for rs in rows.values()]
    for row in table:  # each server against itself with its cache off
        off = "off" if not row.store.startswith(PEER) else f"{PEER} off"
        base = _median(rows[off]).ttft_later_s if off in rows else None
        if base and row.ttft_later_s is not None:
            row.ratio = row.ttft_later_s / base
    print(f"{shape.sessions} sessions x {shape.turns} turns, -np {slots}, {shape.clients} clients")
    shown = [{k: v for k, v in asdict(r).items() if k != "turns"} for r in table]
    print(format_table(shown, COLUMNS))
    print(verdict(table))
    if args.out:
        json_path, _ = out_paths(args.out)
        write_json(json_path, {"rows": [asdict(r) for rs in rows.values() for r in rs]})
        print(f"wrote {json_path}")


def _peer_row(
    name: str, mb: float | None, args: argparse.Namespace, slots: int, shape: Shape, log: Path
) -> SessionRow:
    """The same sessions against llama-server on the same GGUF, its RAM cache at `mb` MiB
    (None: its own default) and its own default speculation (--spec-default)."""
    from specserve.bench.llama_server import LlamaServer, LlamaServerSpec

    gguf = _peer_gguf(args)
    ctx = args.ctx_size or PEER_CTX_PER_SLOT
    cache = PEER_DEFAULT_CACHE_MIB if mb is None else mb
    spec = LlamaServerSpec(args.llama_server, gguf, slots, ctx, cache, threads=args.threads)
    with LlamaServer(spec, log) as srv:
        warm_up(srv.url)
        turns = run_sessions(srv.url, shape)
        peak = srv.peak_rss_mib()
    row = summarise(name, turns, peak)
    row.budget_mib = cache
    return row


def _peer_gguf(args: argparse.Namespace) -> Path:
    """The GGUF llama-server loads: the benchmark's own model file."""
    from specserve.loading.sources import resolve_model

    exe = Path(args.llama_server)
    if not exe.is_file():
        raise SpecserveError(
            f"no llama-server at {exe}: build it with ../shared/tools/build-llama-cpp"
        )
    gguf = resolve_model(str(args.model))
    if gguf.suffix != ".gguf":
        raise SpecserveError(f"--llama-server needs a GGUF model; {args.model} is {gguf}")
    return gguf


def _median(rows: list[SessionRow]) -> SessionRow:
    return median_of(rows, lambda r: r.ttft_later_s or 0.0)


def verdict(table: list[SessionRow]) -> str:
    on = next((r for r in table if r.store == "on"), None)
    if on is None or on.ratio is None:
        return "no store-on row with a store-off row to compare"
    ttft = "meets" if on.ratio <= TARGET_TTFT_RATIO else "misses"
    cached = "meets" if on.cached_min >= TARGET_CACHED_SHARE else "misses"
    return (
        f"store on: turns 2+ TTFT {on.ratio:.2f}x of off ({ttft} <= {TARGET_TTFT_RATIO}x); "
        f"least cached share of a returning prompt {on.cached_min:.1%} ({cached} >= "
        f"{TARGET_CACHED_SHARE:.0%})"
    )
