"""`specserve serve --replicas N ...`: the cluster flags (importable without Ray)."""

from __future__ import annotations

import argparse

SETUP_HINT = "install the cluster extra: `make setup-cluster` (pip install 'specserve[cluster]')"


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cluster (Ray Serve; docs/scaling.md)")
    c.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="serve N replicas, each an engine with its own slots, behind one endpoint on Ray "
        f"Serve, routed by prompt prefix and load (default 0: one process, no Ray; {SETUP_HINT})",
    )
    c.add_argument(
        "--ray-address",
        default=None,
        help="join the Ray cluster `ray start --head` made there (default: a local Ray instance)",
    )
    c.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica (default 1)")
    c.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="autoscale between --min-replicas and --max-replicas (Ray Serve's autoscaling; "
        "--replicas is the starting count)",
    )
    c.add_argument("--max-replicas", type=int, default=None, help="autoscaling's upper bound")
    c.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling's target of requests per replica (default: the replica's slots)",
    )
    c.add_argument(
        "--affinity-threshold",
        type=int,
        default=None,
        help="a turn goes to the replica holding its prefix unless that one has more than "
        "this many requests over the least loaded (default: a replica's slots, -np)",
    )
    c.add_argument(
        "--affinity-min-match",
        type=int,
        default=16,
        help="prompt tokens a replica must hold for affinity; fewer: power of two choices "
        "(default 16)",
    )

    c.add_argument(
        "--router",
        choices=["affinity", "pow2"],
        default="affinity",
        help="affinity (default): by prompt prefix, then load; pow2: Ray Serve's default "
        "power of two choices, blind to prefixes (a baseline for benchmarks)",
    )
    c.add_argument(
        "--share-outputs",
        action="store_true",
        help="replicas pass each other their finished outputs, so every suffix speculator's "
        "global tree learns what all replicas generated, not just its own (off by default)",
    )


def wants_cluster(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "replicas", 0)) or getattr(args, "max_replicas", None) is not None


def autoscaling(args: argparse.Namespace) -> dict[str, float] | None:
    """Ray Serve's autoscaling_config from the flags, or None for a fixed --replicas."""
    if args.min_replicas is None and args.max_replicas is None:
        return None
    lo = args.min_replicas if args.min_replicas is not None else 1
    hi = args.max_replicas if args.max_replicas is not None else max(lo, args.replicas)
    if not 0 <= lo <= hi or hi < 1:
        raise ValueError(f"need 0 <= --min-replicas <= --max-replicas >= 1, got {lo}, {hi}")
    target = args.target_ongoing_requests or float(args.parallel)
    start = min(max(args.replicas or lo, lo), hi)
    return {
        "min_replicas": lo,
        "max_replicas": hi,
        "initial_replicas": start,
        "target_ongoing_requests": target,
    }
