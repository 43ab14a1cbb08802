"""Deploy the cluster app on Ray Serve and run it: `specserve serve --replicas N`.

ray.init (local, or --ray-address)  ->  serve.start(http on --host:--port)
Ingress (0 CPUs, Ray's HTTP proxy in front)  --AffinityRouter-->  N x Replica (1 CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from specserve.cluster.flags import SETUP_HINT, autoscaling
from specserve.errors import SpecserveError
from specserve.server.transport import free_port

log = logging.getLogger("specserve.cluster")
APP_NAME = "specserve"


def require_ray() -> Any:
    """Ray Serve's module, or a clear error naming how to install it."""
    try:
        from ray import serve
    except ImportError as e:
        raise SpecserveError(
            f"--replicas needs Ray Serve, which is not installed: {SETUP_HINT}"
        ) from e
    return serve


def _runtime_env() -> dict[str, Any]:
    """Workers import this very specserve (a checkout run in place, too)."""
    import specserve

    src = str(Path(specserve.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def replica_args(args: argparse.Namespace) -> argparse.Namespace:
    """The serve flags a replica builds its engine from (no callables, no cluster flags)."""
    kept = {k: v for k, v in vars(args).items() if k != "func"}
    return argparse.Namespace(**kept)


def build_application(args: argparse.Namespace) -> Any:
    serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    from specserve.cluster.ingress import Ingress, IngressOptions
    from specserve.cluster.replica import Replica
    from specserve.cluster.router import AffinityRouter

    if args.router == "pow2":
        from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

        router = RequestRouterConfig(request_router_class=PowerOfTwoChoicesRequestRouter)  # type: ignore[arg-type]
    else:
        router = RequestRouterConfig(
            request_router_class=AffinityRouter,  # type: ignore[arg-type]
            request_router_kwargs={
                # a turn waits for about one turn of its home replica at most: past that,
                # re-prefilling elsewhere is sooner than the queue (docs/scaling.md)
                "threshold": threshold(args),
                "min_match": args.affinity_min_match,
            },
        )
    scaling = autoscaling(args)
    count: dict[str, Any] = (
        {"autoscaling_config": scaling} if scaling else {"num_replicas": args.replicas}
    )
    replica = serve.deployment(
        Replica,
        name="SpecserveReplica",
        ray_actor_options={"num_cpus": args.replica_cpus},
        # the engine's own capacity; Ray holds the rest in the router until a replica frees
        max_ongoing_requests=args.parallel + args.max_queue,
        request_router_config=router,
        health_check_period_s=5,
        **count,
    )
    ingress = serve.deployment(
        Ingress,
        name="SpecserveIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,
    )
    return ingress.bind(replica.bind(replica_args(args)), IngressOptions(args.model))


def threshold(args: argparse.Namespace) -> int:
    """--affinity-threshold, or by default the replica's slots."""
    given = args.affinity_threshold
    return args.parallel if given is None else given


def start(args: argparse.Namespace) -> str:
    """Ray up, the app deployed and warm: the URL clients use."""
    serve = require_ray()
    import ray

    if not ray.is_initialized():
        extra: dict[str, Any] = {} if args.ray_address else {"include_dashboard": False}
        ray.init(address=args.ray_address, runtime_env=_runtime_env(), **extra)
    port = args.port or free_port(args.host)  # Ray's proxy needs a port number, not 0
    serve.start(http_options={"host": args.host, "port": port})
    serve.run(build_application(args), name=APP_NAME, route_prefix="/")
    return f"http://{args.host}:{port}"


def stop() -> None:
    """The app, Serve, the board and (if this process started it) Ray."""
    import ray
    from ray import serve

    from specserve.cluster import board

    serve.shutdown()
    with contextlib.suppress(ValueError):  # never created
        ray.kill(ray.get_actor(board.NAME, namespace=board.NAMESPACE))
    ray.shutdown()


def run_cluster(args: argparse.Namespace) -> None:
    """Serve until SIGTERM / Ctrl-C, then take the app and Ray down."""
    logging.getLogger("specserve").setLevel(logging.INFO)
    logging.getLogger("specserve").addHandler(logging.StreamHandler())
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        url = start(args)
        # the same "running on URL" a one-process server's uvicorn logs (benchmarks read it)
        log.info("Ray Serve running on %s: %d replicas of %s", url, args.replicas, args.model)
        done.wait()
    finally:
        stop()
