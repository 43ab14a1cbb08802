"""FastAPI app: OpenAI routes, /health, /metrics, /slots, the chat page; OpenAI errors.

    POST /v1/chat/completions, /v1/completions, /v1/responses   (stream or not)
    GET  /v1/models, /health, /metrics, /slots
    GET  /  (the chat page, server/chat_page.py; off with --no-webui)

Every error is `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status;
bad input is a 400 (FastAPI's default 422 for wrong field types is replaced).
The engine lives in an `EngineLoop` thread that the app's lifespan starts and, on
shutdown (after uvicorn has drained the open connections), stops.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.request import SpecParams
from specserve.loading.tokenizer import Tokenizer
from specserve.server import chat_page, metrics
from specserve.server.errors import ApiError
from specserve.server.generate import OpenAIEndpoints
from specserve.server.loop import EngineLoop
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from specserve.server.replies import ErrorDetail, ErrorResponse, ModelCard, ModelList
from specserve.server.request_id import RequestIdMiddleware
from specserve.server.transport import TransportLimits, TransportMiddleware

log = logging.getLogger("specserve.server")


@dataclass
class ServerConfig:
    """What the HTTP layer needs to know besides the engine loop and tokenizer."""

    model_id: str
    api_key: str | None = None
    spec_types: tuple[str, ...] = ()
    # per-request speculation defaults (--draft-max/--draft-min/--draft-p-min)
    spec_defaults: SpecParams = field(default_factory=lambda: SpecParams(n_max=0))
    drain_timeout: float = 25.0
    transport: TransportLimits = field(default_factory=TransportLimits)
    webui: bool = True  # the chat page at /
    created: int = field(default_factory=lambda: int(time.time()))


def build_app(loop: EngineLoop, tokenizer: Tokenizer, cfg: ServerConfig) -> FastAPI:
    """The app for one model; its lifespan starts and stops the engine thread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # what is alive now (model, tokenizer, modules) lives as long as the server: frozen,
        # no full collection scans it again, so a collection, which holds the GIL and so the
        # event loop, costs the garbage of requests only (as vLLM does after start-up)
        gc.collect()
        gc.freeze()
        loop.start()
        yield
        # uvicorn has drained the connections by now; stop() waits for stragglers
        await asyncio.to_thread(loop.stop, cfg.drain_timeout)
        log.info("engine stopped")

    app = FastAPI(title="specserve", lifespan=lifespan)
    _install_error_handlers(app)
    gen = OpenAIEndpoints(loop, tokenizer, cfg.model_id, cfg.spec_types, cfg.spec_defaults)
    # the Host and API key checks and the body limits run before a handler reads the body
    page = chat_page.PATHS if cfg.webui else frozenset()
    app.add_middleware(
        TransportMiddleware, limits=cfg.transport, api_key=cfg.api_key, open_paths=page
    )
    app.add_middleware(RequestIdMiddleware)  # outermost: its id names the refusals too
    v1 = APIRouter()

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
        return loop.status.slots

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = loop.health.report(loop.alive)  # loading, stalled, error or ok
        return JSONResponse(body, status)

    registry = metrics.registry(loop, cfg.model_id)  # this app's own, not the global one

    @app.get("/metrics")
    async def metrics_page() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    app.include_router(v1)
    if cfg.webui:
        chat_page.add_chat_page(app)
    return app


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
    if not loc and first.get("type") == "value_error":  # the whole body's check refused it
        return ApiError(400, str(first["msg"]).removeprefix("Value error, "))
    if not loc:
        # the body was not parsed as a JSON object: often `curl -d` without a JSON header
        return ApiError(400, "the body must be a JSON object sent as application/json")
    param = ".".join(loc)
    return ApiError(400, f"{param}: {first['msg']}", param=param)
