"""`bench serve --replicas`: its rows, ratios and the servers' flags (the run needs Ray)."""

from __future__ import annotations

from specserve.bench.replicas import ReplicaRow, ratios, settings, verdict
from specserve.bench.server_process import _URL_LINE, ServerSpec
from specserve.bench.sessions import summarise
from specserve.cli import build_parser


def test_one_router_for_one_replica_both_for_more() -> None:
    assert settings([2, 1]) == [
        ("1 affinity", 1, "affinity"),
        ("2 affinity", 2, "affinity"),
        ("2 pow2", 2, "pow2"),
    ]


def test_affinity_is_measured_against_pow2_at_the_same_count() -> None:
    rows = []
    for n, router, ttft in [(1, "affinity", 0.2), (2, "affinity", 0.3), (2, "pow2", 1.2)]:
        row = ReplicaRow(f"{n} {router}", n, router, 10.0, summarise(router, [], 0.0))
        row.sessions.ttft_later_s = ttft
        rows.append(row)
    ratios(rows)
    assert [r.sessions.ratio for r in rows] == [None, 0.25, 1.0]
    assert "0.25x pow2's (meets <= 0.5x)" in verdict(rows)


def test_cluster_servers_get_their_flags_and_url_line() -> None:
    flags = ServerSpec(replicas=2, router="pow2", threads=0, share_outputs=True).flags()
    assert flags[flags.index("--replicas") + 1] == "2"
    assert flags[flags.index("--router") + 1] == "pow2"
    assert flags[flags.index("--threads") + 1] == "1"  # one thread a replica by default
    assert "--share-outputs" in flags
    assert ServerSpec(replicas=2).argv()[1:4] == ["-m", "specserve.cli", "serve"]
    assert "--replicas" not in ServerSpec().flags()
    line = "Ray Serve running on http://127.0.0.1:8123: 2 replicas of m"
    m = _URL_LINE.search(line)
    assert m is not None and m.group(1) == "http://127.0.0.1:8123"
    m = _URL_LINE.search("INFO:     Uvicorn running on http://127.0.0.1:9 (Press CTRL+C)")
    assert m is not None and m.group(1) == "http://127.0.0.1:9"
    args = build_parser().parse_args(["bench", "serve", "--sessions", "4", "--replicas", "1", "2"])
    assert args.replicas == [1, 2]
