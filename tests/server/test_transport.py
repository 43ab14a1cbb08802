"""Transport limits (server/transport.py): slowloris, keep-alive, body size and timeouts, API
key before the body, allowed hosts, and SIGTERM with a half-sent body. Raw sockets where the
test needs to stop mid-request; every read has a timeout."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.loading.model import LoadedModel
from specserve.server.cli_args import add_serve_args, transport_limits
from specserve.server.transport import (
    MISSING_KEY,
    TransportLimits,
    TransportMiddleware,
    host_allowed,
    uvicorn_config,
)
from tests.server.conftest import MODEL_ID, LiveServer, pump_lines, start_server, wait_for_line

LIMIT = 4096  # bytes: a small body limit, so the tests send little
CHAT = "/v1/chat/completions"
HELLO = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
FAST = TransportLimits(
    max_body=LIMIT, header_timeout=1.0, body_timeout=1.0, keep_alive_timeout=1, drain_timeout=2
)
KEY = "sekret"


@pytest.fixture(scope="module")
def limited(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    """Short timeouts and a 4 KiB body limit; no API key."""
    server = start_server(tiny_model, parallel=2, limits=FAST)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    """An API key and allowed hosts; /metrics behind the key."""
    limits = TransportLimits(allowed_hosts=("127.0.0.1", "*.example.com"), drain_timeout=2)
    server = start_server(tiny_model, parallel=1, api_key=KEY, limits=limits)
    yield server
    server.stop()


# -- raw HTTP -------------------------------------------------------------------------------


def connect(server: LiveServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def head(method: str, path: str, host: str = "127.0.0.1", **headers: str | int) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Status, lower-cased headers and body of one Content-Length response."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response: {data!r}"
        data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
    size = int(headers.get("content-length", 0))
    while len(body) < size and (chunk := sock.recv(65536)):
        body += chunk
    return int(status_line.split()[1]), headers, body[:size]


def request(
    server: LiveServer, method: str, path: str, host: str = "127.0.0.1", key: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One bodiless request on its own connection, with `key` as the bearer key if given."""
    auth = {"Authorization": f"Bearer {key}"} if key is not None else {}
    with connect(server) as sock:
        sock.sendall(head(method, path, host, **auth))
        return read_response(sock)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the socket within `seconds` (reading whatever comes first)."""
    deadline = time.monotonic() + seconds
    try:
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            if not sock.recv(65536):
                return True
            if time.monotonic() > deadline:
                return False
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def openai_error(body: bytes, code: str) -> str:
    """The message of an OpenAI error body with this code."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert error["type"] == "invalid_request_error"
    return str(error["message"])


def is_health(response: tuple[int, dict[str, str], bytes]) -> bool:
    """/health's own answer (ok, or 503 while the engine warms up), not a refusal."""
    return response[0] in (200, 503) and "status" in json.loads(response[2])


def chat_text(server: LiveServer) -> str:
    got = httpx2.post(server.url + CHAT, json={**HELLO, "temperature": 0}, timeout=30)
    assert got.status_code == 200, got.text
    return str(got.json()["choices"][0]["message"]["content"])


# -- slowloris and idle sockets ---------------------------------------------------------------


def test_slowloris_connections_are_closed_while_others_are_served(limited: LiveServer) -> None:
    usual = chat_text(limited)
    partial = [b"", b"POST /v1/chat/compl", head("POST", CHAT, Content_Length=10)[:-2]]
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(connect(limited)) for _ in range(64)]
        opened = time.monotonic()
        for i, sock in enumerate(socks):
            sock.sendall(partial[i % 3])
        assert chat_text(limited) == usual  # served on its own connection meanwhile
        # the timer runs from the first byte: a header line every 0.25 s does not keep it open
        tricklers = socks[2::3][:8]
        while time.monotonic() - opened < FAST.header_timeout + 0.5:
            for sock in tricklers:
                with contextlib.suppress(OSError):  # already closed: what the test wants
                    sock.sendall(b"X-Slow: 1\r\n")
            time.sleep(0.25)
        deadline = opened + FAST.header_timeout + 3
        closed = [closed_within(s, max(deadline - time.monotonic(), 0)) for s in socks]
        assert [i for i, c in enumerate(closed) if not c] == []  # the ones still open
    assert chat_text(limited) == usual


def test_idle_keep_alive_socket_is_closed_after_the_keep_alive_timeout(
    limited: LiveServer,
) -> None:
    with connect(limited) as sock:
        sock.sendall(head("GET", "/v1/models"))
        status, headers, _ = read_response(sock)
        assert status == 200 and headers.get("connection") != "close"
        assert not closed_within(sock, FAST.keep_alive_timeout / 2)  # kept alive at first
        assert closed_within(sock, FAST.keep_alive_timeout + 2)


# -- the body ---------------------------------------------------------------------------------


def test_declared_body_over_the_limit_is_413_before_it_is_sent(limited: LiveServer) -> None:
    with connect(limited) as sock:
        sock.sendall(head("POST", CHAT, Content_Type="application/json", Content_Length=10**8))
        sock.sendall(b'{"model": "tiny", ')  # the rest never comes
        status, headers, body = read_response(sock)
        assert status == 413 and headers["connection"] == "close"
        assert str(LIMIT) in openai_error(body, "request_too_large")
        assert closed_within(sock, 2)


def test_chunked_body_over_the_limit_is_413(limited: LiveServer) -> None:
    with connect(limited) as sock:
        sock.sendall(
            head("POST", CHAT, Content_Type="application/json", Transfer_Encoding="chunked")
        )
        chunk = b'{"pad": "' + b"x" * 1000
        for _ in range(LIMIT // len(chunk) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, _, body = read_response(sock)
        assert status == 413
        openai_error(body, "request_too_large")


def test_chunked_body_under_the_limit_is_served(limited: LiveServer) -> None:
    body = json.dumps({**HELLO, "temperature": 0}).encode()
    with connect(limited) as sock:
        sock.sendall(
            head("POST", CHAT, Content_Type="application/json", Transfer_Encoding="chunked")
        )
        for part in (body[:10], body[10:]):
            sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
        sock.sendall(b"0\r\n\r\n")
        status, _, answer = read_response(sock)
    assert status == 200
    assert json.loads(answer)["choices"][0]["message"]["content"] == chat_text(limited)


def test_half_sent_body_is_408_after_the_body_timeout(limited: LiveServer) -> None:
    with connect(limited) as sock:
        sock.sendall(head("POST", CHAT, Content_Type="application/json", Content_Length=100))
        sock.sendall(b'{"model": ')
        sent = time.monotonic()
        status, headers, body = read_response(sock, timeout=FAST.body_timeout + 5)
        assert time.monotonic() - sent > FAST.body_timeout * 0.8
        assert status == 408 and headers["connection"] == "close"
        openai_error(body, "request_timeout")
        assert closed_within(sock, 2)


def test_the_app_never_sees_more_than_the_limit_and_streams_pass_unbuffered() -> None:
    seen: list[int] = []
    sent: list[Message] = []
    outer_saw_first_chunk = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"1", "more_body": True})
            # a buffering middleware would hold chunk 1 back and this wait would time out
            await asyncio.wait_for(outer_saw_first_chunk.wait(), 5)
            await send({"type": "http.response.body", "body": b"2"})
            return
        while (message := await receive())["type"] == "http.request":
            seen.append(len(message["body"]))
            if not message["more_body"]:
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def endless() -> Message:
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    async def outer_send(message: Message) -> None:
        sent.append(message)
        if message.get("body") == b"1":
            outer_saw_first_chunk.set()

    async def run(path: str, headers: list[tuple[bytes, bytes]]) -> None:
        mw = TransportMiddleware(app, TransportLimits(max_body=LIMIT), api_key=None)
        scope: Scope = {"type": "http", "path": path, "headers": headers}
        await asyncio.wait_for(mw(scope, endless, outer_send), 10)

    asyncio.run(run("/v1/completions", [(b"transfer-encoding", b"chunked")]))
    assert sum(seen) <= LIMIT and sent[0]["status"] == 413
    assert (b"connection", b"close") in sent[0]["headers"]
    assert len(sent) == 2  # the 413's start and body: the app's own 200 was dropped
    sent.clear()
    asyncio.run(run("/stream", []))
    assert [m.get("body") for m in sent[1:]] == [b"1", b"2"]


# -- API key, /metrics and hosts --------------------------------------------------------------


def test_missing_key_is_401_before_a_large_body_is_read(keyed: LiveServer) -> None:
    with connect(keyed) as sock:
        # 50 MB declared, over the default limit too: the key is checked first
        sock.sendall(head("POST", CHAT, Content_Type="application/json", Content_Length=50 * 10**6))
        status, headers, body = read_response(sock)
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert headers["connection"] == "close"
        assert openai_error(body, "invalid_api_key") == MISSING_KEY


def test_wrong_key_is_401_and_the_right_key_is_served(keyed: LiveServer) -> None:
    status, _, body = request(keyed, "GET", "/v1/models", key="nope")
    assert status == 401 and openai_error(body, "invalid_api_key") == "invalid API key"
    status, _, body = request(keyed, "GET", "/v1/models", key=KEY)
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL_ID


def test_health_and_openapi_are_open_and_metrics_needs_the_key(keyed: LiveServer) -> None:
    assert is_health(request(keyed, "GET", "/health"))
    assert request(keyed, "GET", "/openapi.json")[0] == 200
    status, _, body = request(keyed, "GET", "/metrics")
    assert status == 401 and openai_error(body, "invalid_api_key") == MISSING_KEY
    assert request(keyed, "GET", "/metrics", key=KEY)[0] == 200


def test_metrics_public_opens_only_metrics(tiny_model: LoadedModel) -> None:
    limits = TransportLimits(metrics_public=True, drain_timeout=2)
    server = start_server(tiny_model, parallel=1, api_key=KEY, limits=limits)
    try:
        assert request(server, "GET", "/metrics")[0] == 200
        assert request(server, "GET", "/v1/models")[0] == 401
    finally:
        server.stop()


def test_a_host_not_allowed_is_400_and_allowed_ones_are_served(keyed: LiveServer) -> None:
    status, _, body = request(keyed, "GET", "/v1/models", "evil.test", KEY)
    assert status == 400 and "evil.test" in openai_error(body, "invalid_host")
    port = keyed.url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", "api.example.com"):
        assert request(keyed, "GET", "/v1/models", host, KEY)[0] == 200
    assert is_health(request(keyed, "GET", "/health", "evil.test"))  # probes by pod IP


def test_host_names() -> None:
    allowed = ("localhost", "*.example.com", "::1")
    assert host_allowed("LOCALHOST:8080", allowed) and host_allowed("a.b.example.com", allowed)
    assert not host_allowed("example.com.evil.test", allowed)
    assert not host_allowed("localhost.evil.test", allowed)
    assert host_allowed("[::1]:8080", ("[::1]",)) and not host_allowed("", allowed)
    assert host_allowed("anything", ("*",))


# -- flags ----------------------------------------------------------------------------------


def test_flags_defaults_and_uvicorn_settings() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    defaults = transport_limits(parser.parse_args([]), max_len=4096)
    assert defaults == TransportLimits(max_body=8 << 20)  # 8 MiB covers 4096 tokens
    assert defaults.header_timeout == 10 and defaults.body_timeout == 30
    assert (defaults.keep_alive_timeout, defaults.drain_timeout) == (5, 25)
    assert defaults.allowed_hosts is None and defaults.limit_concurrency is None
    assert transport_limits(parser.parse_args([]), max_len=1 << 20).max_body == 64 << 20
    argv = ["--max-body-mb", "0.5", "--allowed-hosts", "a.test, *.b.test", "--metrics-public"]
    argv += ["--header-timeout", "2", "--limit-concurrency", "9", "--drain-timeout", "3"]
    limits = transport_limits(parser.parse_args(argv), max_len=4096)
    assert limits.max_body == 1 << 19 and limits.allowed_hosts == ("a.test", "*.b.test")
    assert limits.metrics_public
    config = uvicorn_config(FastAPI(), limits)
    assert (config.limit_concurrency, config.timeout_graceful_shutdown) == (9, 3)
    protocol = config.http
    assert isinstance(protocol, type) and issubclass(protocol, H11Protocol)
    assert getattr(protocol, "header_timeout", None) == 2


# -- SIGTERM ----------------------------------------------------------------------------------


def test_sigterm_with_a_half_sent_body_exits_within_the_drain_timeout(tiny_folder: Path) -> None:
    drain = 2
    cmd = [sys.executable, "-m", "specserve.server.cli_args", "--model", str(tiny_folder)]
    cmd += ["--dtype", "float64", "--device", "cpu", "--port", "0", "-np", "1", "-c", "64"]
    cmd += ["--spec-type", "none", "--drain-timeout", str(drain), "--body-timeout", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see conftest.one_torch_thread
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    threading.Thread(target=pump_lines, args=(proc.stderr, lines), daemon=True).start()
    try:
        host, port = wait_for_line(lines, r"Uvicorn running on http://([\d.]+):(\d+)", 60).groups()
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(head("POST", CHAT, Content_Type="application/json", Content_Length=100))
            sock.sendall(b'{"model": ')
            time.sleep(0.3)  # the request is in the app, waiting for its body
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            proc.wait(timeout=drain + 8)
            assert time.monotonic() - signalled < drain + 4
            assert closed_within(sock, 1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
