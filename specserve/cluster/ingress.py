"""`Ingress`: the HTTP entry of the cluster behind Ray Serve's proxy.

Every OpenAI route (and the chat page) is forwarded whole to a replica through a
deployment handle, with the prompt's token ids as the router's key (keys.py, router.py);
the answer streams back as the replica sends it. /health and /metrics are the ingress's
own: live replicas, and every replica's metrics merged (board.py).

A replica that dies before the first byte of its answer reached the client costs nothing:
the call is retried on another replica. One that dies after ends its stream with an
error event (calls.stream_error), never with a silent truncation.
"""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations through
# Ray's ingress wrapper, which does not resolve strings

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from specserve.cluster import board, keys
from specserve.cluster.calls import RouteCall, Start, stream_error
from specserve.cluster.replica import board_actor
from specserve.loading.sources import resolve_model
from specserve.loading.tokenizer import load_tokenizer

log = logging.getLogger("specserve.cluster")

# the replica died, or could not be reached: the call may go to another one
LOST = (RayActorError, ActorUnavailableError)
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"

api = FastAPI(title="specserve cluster")


@dataclass(frozen=True)
class IngressOptions:
    model: str
    retries: int = 3  # tries after the first, each on a replica Ray still lists


class _Lost(Exception):
    """Every try hit a replica that died before answering."""


def _error(status: int, message: str) -> JSONResponse:
    body = {"message": message, "type": "server_error", "param": None, "code": None}
    return JSONResponse({"error": body}, status)


async def _relay(
    first: bytes, rest: DeploymentResponseGenerator, kind: str
) -> AsyncIterator[bytes]:
    yield first
    try:
        async for chunk in rest:
            yield chunk
    except LOST as e:
        log.warning("replica lost mid-answer: %s", e)
        yield stream_error(f"the replica serving this request died: {e}", kind)


# Ray pickles the class with the module's globals as they are here: helpers go above it


@serve.ingress(api)
class Ingress:
    def __init__(self, replicas: DeploymentHandle, opts: IngressOptions) -> None:
        self.replicas = replicas.options(stream=True)
        self.opts = opts
        self.tok = load_tokenizer(resolve_model(opts.model))
        self.board = board_actor()

    @api.get("/health")
    async def health(self) -> JSONResponse:
        live = await self.board.live.remote()
        ok = sum(1 for status, _ in live.values() if status == 200)
        body: dict[str, Any] = {"status": "ok" if ok else "error", "replicas": ok}
        if not ok:
            body["message"] = f"no live replica ({len(live)} reporting, none ok)"
        return JSONResponse(body, 200 if ok else 503)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        live = await self.board.live.remote()
        pages = {replica: text for replica, (_, text) in live.items()}
        merged = await asyncio.to_thread(board.merge_pages, pages)
        return Response(merged, media_type=METRICS_TYPE)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        call = RouteCall(
            request.method,
            request.url.path,
            request.scope.get("query_string", b""),
            list(request.scope["headers"]),
            body,
        )
        if request.method == "POST":
            call.tokens = await asyncio.to_thread(keys.routing_key, self.tok, call.path, body)
        try:
            start, first, rest = await self._first_bytes(call)
        except _Lost as e:
            return _error(503, f"no replica could take the request: {e}")
        headers = dict(start["headers"])
        headers.pop("content-length", None)  # the proxy re-frames the body
        kind = headers.get("content-type", "")
        return StreamingResponse(
            _relay(first, rest, kind), status_code=start["status"], headers=headers
        )

    async def _first_bytes(
        self, call: RouteCall
    ) -> tuple[Start, bytes, DeploymentResponseGenerator]:
        """Call a replica until one sends its response start and first body chunk."""
        for attempt in range(self.opts.retries + 1):
            call.attempt = attempt
            gen = self.replicas.handle.remote(call)
            assert isinstance(gen, DeploymentResponseGenerator)
            try:
                start = await gen.__anext__()
                try:
                    first = await gen.__anext__()
                except StopAsyncIteration:
                    first = b""
                return start, first, gen
            except LOST as e:
                log.warning("replica lost before answering (try %d): %s", attempt + 1, e)
                last = e
        raise _Lost(str(last))
