"""`Replica`: one Ray Serve deployment replica holding one Engine (its slots, prompt cache
and speculators) behind the one-server FastAPI app, which it runs in process (calls.py).

Ray restarts a replica whose actor dies or whose `check_health` raises (the engine
thread ended, or stalled: server/health.py).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from specserve.cluster import board
from specserve.cluster.calls import RouteCall, Start, call_asgi
from specserve.errors import SpecserveError
from specserve.server import metrics
from specserve.server.app import build_app
from specserve.server.cli_args import build_server
from specserve.server.exchange import OutputExchange

log = logging.getLogger("specserve.cluster")

REPLICA_HEADER = "x-specserve-replica"  # which replica answered (tests, debugging)
WARM_UP_TIMEOUT_S = 600.0


class Replica:
    def __init__(self, args: argparse.Namespace) -> None:
        self.loop, cfg, loaded = build_server(args)
        assert loaded.tokenizer is not None
        self.app = build_app(self.loop, loaded.tokenizer, cfg)
        self.registry = metrics.registry(self.loop, cfg.model_id)
        self.loop.start()  # the app's lifespan would; the in-process calls skip lifespans
        self.id = serve.get_replica_context().replica_id.unique_id
        self._wait_warm()
        self._board = board_actor()
        if args.share_outputs:
            self.loop.exchange = OutputExchange()
        self._cursor = 0  # where this replica is in the board's log of shared outputs
        self._stop = threading.Event()
        # posted before Serve marks this replica running, so /health counts it at once
        try:
            ray.get(self._post_once(), timeout=30)
        except Exception as e:  # noqa: BLE001 - the board restarts; the loop posts again
            log.warning("could not post to the board: %s", e)
        threading.Thread(target=self._post, name="board", daemon=True).start()

    def _wait_warm(self) -> None:
        """Only a warm replica is marked running: routing starts after the warm-up."""
        deadline = time.monotonic() + WARM_UP_TIMEOUT_S
        while not self.loop.health.ready:
            if not self.loop.alive or time.monotonic() > deadline:
                raise SpecserveError(self.loop.health.error or "the engine did not warm up")
            time.sleep(0.05)

    def _post_once(self) -> Any:
        """Post this replica's health and metrics to the board; the call's ObjectRef."""
        status, _ = self.loop.health.report(self.loop.alive)
        page = metrics.render(self.registry).decode()
        return self._board.post.remote(self.id, status, page)

    def _post(self) -> None:
        while not self._stop.wait(board.PERIOD_S):
            try:
                self._post_once()
                if self.loop.exchange is not None:
                    self._share(self.loop.exchange)
            except Exception as e:  # noqa: BLE001 - the board restarts; keep serving
                log.warning("could not post to the board: %s", e)

    def _share(self, exchange: OutputExchange) -> None:
        """Send what this replica finished; queue what the others did for its engine."""
        call = self._board.exchange.remote(self.id, exchange.take(), self._cursor)
        self._cursor, theirs = ray.get(call, timeout=30)
        exchange.give(theirs)

    async def handle(self, call: RouteCall) -> AsyncIterator[Start | bytes]:
        """One HTTP request on this replica's app: its start (status, headers), then body."""
        async for item in call_asgi(self.app, call):
            if isinstance(item, dict):
                item["headers"].append((REPLICA_HEADER, self.id))
            yield item

    def check_health(self) -> None:
        status, body = self.loop.health.report(self.loop.alive)
        if status != 200:
            raise SpecserveError(f"replica {self.id}: {body}")

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        if hasattr(self, "loop"):
            self.loop.stop(5.0)


def board_actor() -> Any:
    """The cluster's one Board actor, created by whoever asks first."""
    actor = ray.remote(num_cpus=0)(board.Board)
    return actor.options(
        name=board.NAME, namespace=board.NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()
