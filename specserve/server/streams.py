"""OpenAI response bodies and their server-sent-event streams, from text deltas + a Finish.

A run is an async iterator of text deltas (str), ending with one `Finish`, or with an
Exception when the engine failed after the stream had started (then the stream carries
OpenAI's `{"error": ...}` body, which the openai client raises as APIError).

Chat and legacy completions stream `data: {chunk}` lines and end with `data: [DONE]`;
the Responses API streams typed events (`event: response.output_text.delta`, ...) and,
as OpenAI's does, no [DONE]. The final chunk or event carries llama.cpp's `timings`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from specserve.server.loop import Timings
from specserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    ErrorDetail,
    ErrorResponse,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesUsage,
    Usage,
)


@dataclass
class Finish:
    """How a generation ended: the last item of a run."""

    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    timings: Timings


Run = AsyncIterator[str | Finish | Exception]


@dataclass
class Ids:
    """The identity every chunk of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def _data(body: BaseModel | dict[str, Any], event: str | None = None) -> str:
    text = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def _error(e: Exception) -> str:
    return _data(ErrorResponse(error=ErrorDetail(message=str(e), type="server_error")))


def _cached(fin: Finish) -> dict[str, int]:
    return {"cached_tokens": int(fin.timings.get("cache_n", 0))}


def _usage(fin: Finish) -> Usage:
    total = fin.prompt_tokens + fin.completion_tokens
    return Usage(
        prompt_tokens=fin.prompt_tokens,
        completion_tokens=fin.completion_tokens,
        total_tokens=total,
        prompt_tokens_details=_cached(fin),
    )


# -- chat completions -----------------------------------------------------------------------


def chat_completion(ids: Ids, text: str, fin: Finish) -> dict[str, Any]:
    choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=fin.reason)
    body = ChatCompletion(
        id=ids.id,
        created=ids.created,
        model=ids.model,
        choices=[choice],
        usage=_usage(fin),
        timings=fin.timings,
    )
    return body.model_dump(mode="json")


async def chat(ids: Ids, run: Run, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], **extra: Any) -> str:
        body = ChatCompletionChunk(
            id=ids.id, created=ids.created, model=ids.model, choices=choices, **extra
        )
        return _data(body)

    yield chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
    async for item in run:
        if isinstance(item, Exception):
            yield _error(item)
            return
        if isinstance(item, str):
            yield chunk([ChatChunkChoice(delta=ChatDelta(content=item))])
            continue
        last = ChatChunkChoice(delta=ChatDelta(), finish_reason=item.reason)
        yield chunk([last], timings=item.timings)
        if include_usage:
            yield chunk([], usage=_usage(item))
    yield "data: [DONE]\n\n"


# -- legacy completions ---------------------------------------------------------------------


def completion_object(ids: Ids, text: str, fin: Finish) -> dict[str, Any]:
    body = Completion(
        id=ids.id,
        created=ids.created,
        model=ids.model,
        choices=[CompletionChoice(text=text, finish_reason=fin.reason)],
        usage=_usage(fin),
        timings=fin.timings,
    )
    return body.model_dump(mode="json")


async def completion(ids: Ids, run: Run, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], **extra: Any) -> str:
        body = Completion(id=ids.id, created=ids.created, model=ids.model, choices=choices, **extra)
        return _data(body)

    async for item in run:
        if isinstance(item, Exception):
            yield _error(item)
            return
        if isinstance(item, str):
            yield chunk([CompletionChoice(text=item)])
            continue
        yield chunk([CompletionChoice(text="", finish_reason=item.reason)], timings=item.timings)
        if include_usage:
            yield chunk([], usage=_usage(item))
    yield "data: [DONE]\n\n"


# -- responses ------------------------------------------------------------------------------


def response_object(ids: Ids, text: str | None, fin: Finish | None) -> dict[str, Any]:
    """The Response: in progress (text None), completed, or incomplete (length)."""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    if fin is not None:
        status = "incomplete" if fin.reason == "length" else "completed"
    output = []
    if text is not None:
        message = OutputMessage(id=_message_id(ids), status=status, content=[OutputText(text=text)])
        output.append(message)
    body = ResponseObject(
        id=ids.id,
        created_at=ids.created,
        status=status,
        model=ids.model,
        output=output,
        usage=None if fin is None else _responses_usage(fin),
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
        timings=None if fin is None else fin.timings,
    )
    return body.model_dump(mode="json")


def _message_id(ids: Ids) -> str:
    return "msg_" + ids.id.removeprefix("resp_")


def _responses_usage(fin: Finish) -> ResponsesUsage:
    total = fin.prompt_tokens + fin.completion_tokens
    return ResponsesUsage(
        input_tokens=fin.prompt_tokens,
        output_tokens=fin.completion_tokens,
        total_tokens=total,
        input_tokens_details=_cached(fin),
    )


async def response_events(ids: Ids, run: Run) -> AsyncIterator[str]:
    """The Responses API's event sequence for one text message."""
    seq = iter(range(1 << 62))
    where = {"item_id": _message_id(ids), "output_index": 0, "content_index": 0}

    def event(kind: str, **fields: Any) -> str:
        return _data({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

    started = response_object(ids, None, None)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    item = {
        "type": "message",
        "id": where["item_id"],
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    yield event("response.output_item.added", output_index=0, item=item)
    part = {"type": "output_text", "text": "", "annotations": []}
    yield event("response.content_part.added", **where, part=part)
    parts: list[str] = []
    async for got in run:
        if isinstance(got, Exception):
            yield _data(
                ErrorResponse(error=ErrorDetail(message=str(got), type="server_error")), "error"
            )
            return
        if isinstance(got, str):
            parts.append(got)
            yield event("response.output_text.delta", **where, delta=got, logprobs=[])
            continue
        text = "".join(parts)
        final = response_object(ids, text, got)
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part={**part, "text": text})
        yield event("response.output_item.done", output_index=0, item=final["output"][0])
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(kind, response=final)
