"""Transport limits: what a client may cost the server before its request reaches a handler.

- `TransportMiddleware` (pure ASGI, so streamed responses pass through unbuffered) checks
  the Host header and the API key before any body byte is read, refuses a declared body over
  the limit at once, counts a chunked body as it arrives, and answers 408 when the client
  stops sending its body. Its own answers are OpenAI error bodies.
- `header_timeout_protocol` is uvicorn's h11 protocol with a timer that closes a connection
  whose request head is not complete in time (slowloris); uvicorn only times idle sockets
  between requests.
- `uvicorn_config` builds uvicorn's settings from the same limits for `specserve serve` and
  the test servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.server.replies import ErrorDetail, ErrorResponse

log = logging.getLogger("specserve.server")

MIB = 1 << 20
MIN_BODY = 8 * MIB
BODY_BYTES_PER_TOKEN = 64  # a JSON-escaped token of text, with room for chat markup
# answered without a key: probes and the API's own description
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>'"


@dataclass(frozen=True)
class TransportLimits:
    """Limits on one connection and request; `specserve serve`'s http flags set them."""

    max_body: int = MIN_BODY  # bytes
    header_timeout: float = 10.0  # s to send a request's line and headers
    body_timeout: float = 30.0  # s the body may stall between two reads
    keep_alive_timeout: int = 5  # s an idle connection stays open between requests
    limit_concurrency: int | None = None  # connections + tasks before uvicorn answers 503
    drain_timeout: int = 25  # s running requests get after SIGTERM
    allowed_hosts: tuple[str, ...] | None = None  # Host names served; None = any
    metrics_public: bool = False  # /metrics without the API key


def default_max_body(max_len: int) -> int:
    """A body limit that fits a prompt filling a context of max_len tokens."""
    return max(MIN_BODY, BODY_BYTES_PER_TOKEN * max_len)


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    """OpenAI's error body, as the app's own error handlers write it."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    detail = ErrorDetail(message=message, type=kind, param=None, code=code)
    return ErrorResponse(error=detail).model_dump_json().encode()


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Host header (port dropped) against names; `*.example.com` matches its subdomains."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal: [::1]:8080
        host = host[: host.find("]") + 1]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    for name in allowed:
        name = name.strip().lower()
        if name == "*" or host == name or (name.startswith("*.") and host.endswith(name[1:])):
            return True
    return False


class TransportMiddleware:
    """Host and API key checks before the body; body size and read-timeout limits."""

    def __init__(
        self,
        app: ASGIApp,
        limits: TransportLimits,
        api_key: str | None,
        open_paths: frozenset[str] = frozenset(),
    ) -> None:
        """open_paths: more paths answered without the key (the chat page's files)."""
        self.app = app
        self.limits = limits
        # several keys, comma-separated (as llama.cpp's --api-key): one tenant each
        self.keys = [k.strip().encode() for k in (api_key or "").split(",") if k.strip()]
        metrics = {"/metrics"} if limits.metrics_public else set()
        self.open_paths = OPEN_PATHS | open_paths | metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await _Exchange(self, scope, receive, send).run()

    def refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[int, str, str] | None:
        """(status, message, code) when the request is refused on its headers alone."""
        path = scope["path"]
        allowed = self.limits.allowed_hosts
        host = headers.get(b"host", b"").decode("latin-1")
        # /health is exempt so that probes which send the pod's IP as Host still work
        if allowed is not None and path != "/health" and not host_allowed(host, allowed):
            return 400, f"host {host!r} is not served here", "invalid_host"
        if self.keys and path not in self.open_paths:
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not given.strip():
                return 401, MISSING_KEY, "invalid_api_key"
            # constant time, every key compared, so no key can be guessed byte by byte (or
            # told apart from another) from response times
            matches = [secrets.compare_digest(given.strip(), key) for key in self.keys]
            if not any(matches):
                return 401, "invalid API key", "invalid_api_key"
            if len(self.keys) > 1:  # each key its own tenant (request.state.key_tenant)
                tenant = "key-" + hashlib.sha256(given.strip()).hexdigest()[:16]
                scope.setdefault("state", {})["key_tenant"] = tenant
        declared = _content_length(headers)
        if declared is not None and declared > self.limits.max_body:
            return 413, self._too_large(), "request_too_large"
        return None

    def _too_large(self) -> str:
        return f"the request body is over the server's limit of {self.limits.max_body} bytes"


class _Exchange:
    """One request through the middleware: wraps receive and send."""

    def __init__(self, mw: TransportMiddleware, scope: Scope, receive: Receive, send: Send) -> None:
        self.mw, self.scope, self._receive, self._send = mw, scope, receive, send
        self.headers = {k.lower(): v for k, v in scope["headers"]}
        declared = _content_length(self.headers)
        self.body_done = b"transfer-encoding" not in self.headers and not declared
        self.received = 0
        self.started = False  # a response has begun on the wire
        self.answered = False  # the middleware answered: the app's sends are dropped

    async def run(self) -> None:
        refused = self.mw.refusal(self.scope, self.headers)
        if refused is not None:
            await self.answer(*refused)
            return
        try:
            await self.mw.app(self.scope, self.receive, self.send)
        except Exception:
            if not self.answered:
                raise
            # the app failed on the disconnect it was handed after the 408/413: nothing to tell
            log.debug("after a transport error: the app raised", exc_info=True)

    async def receive(self) -> Message:
        if self.answered:
            return {"type": "http.disconnect"}
        if self.body_done:  # waits for a disconnect while streaming: no time limit
            return await self._receive()
        try:
            async with asyncio.timeout(self.mw.limits.body_timeout):
                message = await self._receive()
        except TimeoutError:
            timeout = self.mw.limits.body_timeout
            await self.answer(408, f"no request body byte for {timeout:g} s", "request_timeout")
            return {"type": "http.disconnect"}
        if message["type"] != "http.request":
            self.body_done = True
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.mw.limits.max_body:
            await self.answer(413, self.mw._too_large(), "request_too_large")
            return {"type": "http.disconnect"}
        self.body_done = not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.started = True
            if not self.body_done:
                # the body's rest is still coming: close rather than read it to keep alive
                message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
        await self._send(message)

    async def answer(self, status: int, message: str, code: str) -> None:
        """Answer with an OpenAI error (or, once a response has begun, give up on it)."""
        self.answered = True
        if self.started:
            return
        self.started = True
        body = error_body(status, message, code)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if not self.body_done:
            headers.append(_CLOSE)
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})


_CLOSE = (b"connection", b"close")


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    try:
        return int(headers[b"content-length"])
    except (KeyError, ValueError):
        return None


class _HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol; a connection must complete each request head in time."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()  # a socket that never sends a byte is closed too

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # the first bytes of a request
            self._arm_header_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # a pipelined request may already be partly in h11's buffer
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.debug("closing a connection whose request head took over %g s", self.header_timeout)
            # h11 may be past the point of a clean close; the socket closes anyway
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class, closing a request head unfinished after header_timeout s."""
    return type("HeaderTimeoutH11", (_HeaderTimeoutH11,), {"header_timeout": header_timeout})


def uvicorn_config(app: ASGIApp, limits: TransportLimits, **kw: Any) -> uvicorn.Config:
    """uvicorn's Config with the limits' protocol and timeouts; kw adds or overrides settings."""
    settings: dict[str, Any] = {
        "http": header_timeout_protocol(limits.header_timeout),
        "timeout_keep_alive": limits.keep_alive_timeout,
        "limit_concurrency": limits.limit_concurrency,
        "timeout_graceful_shutdown": limits.drain_timeout,
    }
    return uvicorn.Config(app, **(settings | kw))


def free_port(host: str = "127.0.0.1") -> int:
    """A port no one listens on now, for a server that needs a number rather than 0 (Ray
    Serve's proxy, llama-server); another process may still take it before ours binds."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
