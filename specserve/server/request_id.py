"""A request id for every HTTP request, and one error shape for what nobody expected.

The id is the client's `X-Request-Id` when it sends a plausible one, else a new one; it
comes back in the response's `x-request-id` header, stands in every log line written
while the request is handled (the `%(request_id)s` field that `RequestIdFilter` adds), and
in the message of a 500. An exception that escapes every handler becomes OpenAI's error
body with status 500 and one log record: the client never sees a traceback.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("specserve.server")

REQUEST_ID: ContextVar[str] = ContextVar("specserve_request_id", default="-")
_PLAUSIBLE = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id`: the id of the request being handled, or "-"."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class RequestIdMiddleware:
    """Outermost ASGI layer: names the request, answers the unexpected with a 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _incoming(scope) or "req_" + uuid.uuid4().hex[:24]
        token = REQUEST_ID.set(rid)
        started = False

        async def send_named(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_named)
        except Exception as e:
            log.exception("request %s failed: %s: %s", rid, type(e).__name__, e)
            if not started:  # once a response has begun, closing it is all that is left
                await _send_500(send, rid)
        finally:
            REQUEST_ID.reset(token)


def _incoming(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _PLAUSIBLE.fullmatch(text) else None
    return None


async def _send_500(send: Send, rid: str) -> None:
    message = f"the server failed on this request (request id {rid}); it is logged"
    error = {"message": message, "type": "server_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", rid.encode()),
    ]
    await send({"type": "http.response.start", "status": 500, "headers": headers})
    await send({"type": "http.response.body", "body": body})
