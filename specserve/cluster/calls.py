"""An HTTP request carried from the ingress to a replica, and run there on the replica's own
FastAPI app in process (no socket): every route, check and error body is the one-server
app's, so a replica answers exactly what `specserve serve` answers.

    ingress:  RouteCall(method, path, headers, body, tokens)  --Ray handle, streaming-->
    replica:  call_asgi(app, call) yields {"status", "headers"}, then body chunks
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

# the replica's answer first yields this dict, then bytes
Start = dict[str, Any]


@dataclass
class RouteCall:
    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    tokens: list[int] = field(default_factory=list)  # the router's key (router.py)
    attempt: int = 0  # retries after a replica died before answering


def _scope(call: RouteCall) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "query_string": call.query,
        "root_path": "",
        "headers": call.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }


async def call_asgi(app: Any, call: RouteCall) -> AsyncIterator[Start | bytes]:
    """Run one request on an ASGI app: its response start, then its body chunks as sent.

    Closing the iterator early (the client went away) tells the app the client
    disconnected, so the engine frees the request's slot as it would over HTTP."""
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(_scope(call), receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [
                    (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
                ]
                yield {"status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 30)


def stream_error(message: str, content_type: str) -> bytes:
    """The last bytes of a cut stream: OpenAI's error event for an SSE stream (the openai
    client raises it as APIError), never a silent end; b"" for other bodies."""
    if not content_type.startswith("text/event-stream"):
        return b""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return f"data: {json.dumps(body)}\n\n".encode()
