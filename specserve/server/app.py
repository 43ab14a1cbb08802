"""FastAPI app: OpenAI routes, /health, /metrics, /slots; errors in OpenAI's shape.

    POST /v1/chat/completions, /v1/completions, /v1/responses   (stream or not)
    GET  /v1/models, /health, /metrics, /slots

Every error is `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status;
bad input is a 400 (FastAPI's default 422 for wrong field types is replaced).
The engine lives in an `EngineLoop` thread that the app's lifespan starts and, on
shutdown (after uvicorn has drained the open connections), stops.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.request import SpecParams
from specserve.loading.tokenizer import Tokenizer
from specserve.server import metrics
from specserve.server.errors import ApiError
from specserve.server.generate import Generator
from specserve.server.loop import EngineLoop
from specserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponsesRequest,
)

log = logging.getLogger("specserve.server")


@dataclass
class ServerConfig:
    """What the HTTP layer needs to know besides the engine loop and tokenizer."""

    model_id: str
    api_key: str | None = None
    spec_types: tuple[str, ...] = ()
    # per-request speculation defaults (--draft-max/--draft-min/--draft-p-min)
    spec_defaults: SpecParams = field(default_factory=lambda: SpecParams(n_max=0))
    drain_timeout: float = 30.0
    created: int = field(default_factory=lambda: int(time.time()))


def build_app(loop: EngineLoop, tokenizer: Tokenizer, cfg: ServerConfig) -> FastAPI:
    """The app for one model; its lifespan starts and stops the engine thread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        yield
        # uvicorn has drained the connections by now; stop() waits for stragglers
        await asyncio.to_thread(loop.stop, cfg.drain_timeout)
        log.info("engine stopped")

    app = FastAPI(title="specserve", lifespan=lifespan)
    _install_error_handlers(app)
    gen = Generator(loop, tokenizer, cfg.model_id, cfg.spec_types, cfg.spec_defaults)
    v1 = APIRouter(dependencies=[Depends(_api_key_check(cfg.api_key))])

    @v1.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await gen.chat(body, request)

    @v1.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await gen.completion(body, request)

    @v1.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await gen.response(body, request)

    @v1.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=cfg.model_id, created=cfg.created)])

    @v1.get("/slots")
    async def slots() -> list[dict[str, Any]]:
        return loop.snapshot.slots

    @app.get("/health")
    async def health() -> JSONResponse:
        if not loop.alive:
            return JSONResponse({"status": "error", "message": "engine not running"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_page() -> PlainTextResponse:
        text = metrics.render_metrics(loop.snapshot, cfg.model_id)
        return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)

    app.include_router(v1)
    return app


def _api_key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency: with --api-key set, requests need `Authorization: Bearer <key>`."""

    # async, so FastAPI runs it on the event loop rather than in its thread pool
    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ApiError(
                401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        # constant time, so the key cannot be guessed byte by byte from response times
        if not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "invalid API key", code="invalid_api_key")

    return check


def error_response(err: ApiError) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorDetail(message=err.message, type=err.type, param=err.param, code=err.code)
    )
    headers = dict(err.headers)
    if err.status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return JSONResponse(body.model_dump(), err.status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = ApiError(exc.status_code, str(exc.detail), type=kind)
        err.headers = dict(exc.headers or {})
        return error_response(err)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)


def validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's validation failure -> a 400 that names the first offending field."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"malformed JSON body: {detail}".rstrip(": "))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc:
        # the body was not parsed as a JSON object: often `curl -d` without a JSON header
        return ApiError(400, "the body must be a JSON object sent as application/json")
    param = ".".join(loc)
    return ApiError(400, f"{param}: {first['msg']}", param=param)
