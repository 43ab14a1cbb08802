"""OpenAI response bodies and their server-sent-event streams, from text deltas + a Finish.

A run is an async iterator of `Delta`s (text, and its tokens' logprobs when asked), ending
with one `Finish`, or with an Exception when the engine failed after the stream had started
(then the stream carries OpenAI's `{"error": ...}` body, which the openai client raises as
APIError).

Chat and legacy completions stream `data: {chunk}` lines and end with `data: [DONE]`;
the Responses API streams typed events (`event: response.output_text.delta`, ...) and,
as OpenAI's does, no [DONE]. The final chunk or event carries llama.cpp's `timings`, and
each chunk of generated text our `speculative` extension (replies.ChunkSpeculation).

With n choices (chat and legacy completions), their runs come merged, each item with its
choice's index, and every chunk names its choice (`index`), as OpenAI's do; each choice's
last chunk carries its own timings. `usage` counts the prompt once and sums the choices'
tokens; a whole response's `timings` sum the choices' token counts (`Choices`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from specserve.server.events import Timings
from specserve.server.logprobs import legacy
from specserve.server.replies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChoiceLogprobs,
    ChunkSpeculation,
    Completion,
    CompletionChoice,
    ErrorDetail,
    ErrorResponse,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesUsage,
    TokenLogprobs,
    ToolCall,
    ToolCallDelta,
    Usage,
)


@dataclass
class Delta:
    """New text, the logprobs of the tokens behind it (None: the request asked none), the
    tool calls that it completed (taken out of the text), the pieces of calls that a
    stream sends as they come, and how many tokens are behind it and how many of those
    were accepted drafts (None: text not generated here)."""

    text: str
    logprobs: list[TokenLogprobs] | None = None
    calls: list[ToolCall] = field(default_factory=list)  # tool calls completed here
    parts: list[ToolCallDelta] = field(default_factory=list)  # calls begun or grown here
    origin: ChunkSpeculation | None = None

    @classmethod
    def join(cls, parts: list[Delta]) -> Delta:
        items = [p.logprobs for p in parts if p.logprobs is not None]
        joined = [i for part in items for i in part] if items else None
        calls = [c for p in parts for c in p.calls]
        return cls("".join(p.text for p in parts), joined, calls)


@dataclass
class Finish:
    """How a generation ended: the last item of a run."""

    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    timings: Timings


Run = AsyncIterator[Delta | Finish | Exception]
Runs = AsyncIterator[tuple[int, Delta | Finish | Exception]]  # choice index, item
Choices = list[tuple[Delta, Finish]]  # each choice's whole text and finish, by index


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


def _usage(fins: list[Finish]) -> Usage:
    """The prompt once (its least cached count: the choice that prefilled it), the
    choices' tokens summed, as OpenAI counts n choices."""
    prompt = fins[0].prompt_tokens
    completion = sum(f.completion_tokens for f in fins)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=min((_cached(f) for f in fins), key=lambda c: c["cached_tokens"]),
    )


_COUNTS = ("cache_n", "prompt_n", "predicted_n", "draft_n", "draft_n_accepted")


def _timings(fins: list[Finish]) -> Timings:
    """One response's timings over its choices: token counts summed (so prompt_n counts the
    prompt prefilled once: the other choices found it all cached), prompt_ms the soonest
    first token, predicted_ms the longest decoding."""
    if len(fins) == 1:
        return fins[0].timings
    ts = [f.timings for f in fins]
    n = {k: sum(int(t.get(k, 0)) for t in ts) for k in _COUNTS}
    prompt_ms = min(float(t.get("prompt_ms", 0.0)) for t in ts)
    predicted_ms = max(float(t.get("predicted_ms", 0.0)) for t in ts)
    decoded = n["predicted_n"] - len(fins)  # each choice's first token is the prompt pass's
    return {
        "cache_n": n["cache_n"],
        "prompt_n": n["prompt_n"],
        "prompt_ms": prompt_ms,
        "prompt_per_second": n["prompt_n"] / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
        "predicted_n": n["predicted_n"],
        "predicted_ms": predicted_ms,
        "predicted_per_second": decoded / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
        "draft_n": n["draft_n"],
        "draft_n_accepted": n["draft_n_accepted"],
    }


# -- chat completions -----------------------------------------------------------------------


def _chat_logprobs(items: list[TokenLogprobs] | None) -> ChoiceLogprobs | None:
    return None if items is None else ChoiceLogprobs(content=items)


def _chat_choice(index: int, got: Delta, fin: Finish) -> ChatChoice:
    # with calls, OpenAI's content is null unless the model also wrote something
    content = got.text if got.text.strip() or not got.calls else None
    message = AssistantMessage(content=content, tool_calls=got.calls or None)
    logprobs = _chat_logprobs(got.logprobs)
    return ChatChoice(index=index, message=message, finish_reason=fin.reason, logprobs=logprobs)


def chat_completion(ids: Ids, got: Choices) -> dict[str, Any]:
    fins = [fin for _, fin in got]
    body = ChatCompletion(
        id=ids.id,
        created=ids.created,
        model=ids.model,
        choices=[_chat_choice(i, *choice) for i, choice in enumerate(got)],
        usage=_usage(fins),
        timings=_timings(fins),
    )
    return body.model_dump(mode="json")


async def chat(ids: Ids, runs: Runs, n: int, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], **extra: Any) -> str:
        body = ChatCompletionChunk(
            id=ids.id, created=ids.created, model=ids.model, choices=choices, **extra
        )
        return _data(body)

    for i in range(n):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    fins: dict[int, Finish] = {}
    async for i, item in runs:
        if isinstance(item, Exception):
            yield _error(item)
            return
        if isinstance(item, Delta):
            text = item.text if item.text or not item.parts else None
            delta = ChatDelta(content=text, tool_calls=item.parts or None)
            choice = ChatChunkChoice(index=i, delta=delta, logprobs=_chat_logprobs(item.logprobs))
            yield chunk([choice], speculative=item.origin)
            continue
        fins[i] = item
        last = ChatChunkChoice(index=i, delta=ChatDelta(), finish_reason=item.reason)
        yield chunk([last], timings=item.timings)
    if include_usage and len(fins) == n:
        yield chunk([], usage=_usage([fins[i] for i in range(n)]))
    yield "data: [DONE]\n\n"


# -- legacy completions ---------------------------------------------------------------------


def _completion_choice(index: int, got: Delta, fin: Finish) -> CompletionChoice:
    lp = None if got.logprobs is None else legacy(got.logprobs)
    return CompletionChoice(index=index, text=got.text, finish_reason=fin.reason, logprobs=lp)


def completion_object(ids: Ids, got: Choices) -> dict[str, Any]:
    fins = [fin for _, fin in got]
    body = Completion(
        id=ids.id,
        created=ids.created,
        model=ids.model,
        choices=[_completion_choice(i, *choice) for i, choice in enumerate(got)],
        usage=_usage(fins),
        timings=_timings(fins),
    )
    return body.model_dump(mode="json")


async def completion(ids: Ids, runs: Runs, n: int, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], **extra: Any) -> str:
        body = Completion(id=ids.id, created=ids.created, model=ids.model, choices=choices, **extra)
        return _data(body)

    offsets = [0] * n  # characters of each choice's tokens before this chunk's (text_offset)
    fins: dict[int, Finish] = {}
    async for i, item in runs:
        if isinstance(item, Exception):
            yield _error(item)
            return
        if isinstance(item, Delta):
            lp = None if item.logprobs is None else legacy(item.logprobs, offsets[i])
            offsets[i] += sum(len(t) for t in lp.tokens) if lp else 0
            choice = CompletionChoice(index=i, text=item.text, logprobs=lp)
            yield chunk([choice], speculative=item.origin)
            continue
        fins[i] = item
        last = CompletionChoice(index=i, text="", finish_reason=item.reason)
        yield chunk([last], timings=item.timings)
    if include_usage and len(fins) == n:
        yield chunk([], usage=_usage([fins[i] for i in range(n)]))
    yield "data: [DONE]\n\n"


# -- responses ------------------------------------------------------------------------------


def response_object(ids: Ids, got: Delta | None, fin: Finish | None) -> dict[str, Any]:
    """The Response: in progress (got None), completed, or incomplete (length)."""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    if fin is not None:
        status = "incomplete" if fin.reason == "length" else "completed"
    output = []
    if got is not None:
        content = OutputText(text=got.text, logprobs=got.logprobs or [])
        output.append(OutputMessage(id=_message_id(ids), status=status, content=[content]))
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


def _dumped(items: list[TokenLogprobs] | None) -> list[dict[str, Any]]:
    return [i.model_dump(mode="json") for i in items or []]


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
    parts: list[Delta] = []
    async for got in run:
        if isinstance(got, Exception):
            yield _data(
                ErrorResponse(error=ErrorDetail(message=str(got), type="server_error")), "error"
            )
            return
        if isinstance(got, Delta):
            parts.append(got)
            lp = _dumped(got.logprobs)
            extra = {"speculative": got.origin.model_dump()} if got.origin else {}
            yield event("response.output_text.delta", **where, delta=got.text, logprobs=lp, **extra)
            continue
        whole = Delta.join(parts)
        final = response_object(ids, whole, got)
        lp = _dumped(whole.logprobs)
        yield event("response.output_text.done", **where, text=whole.text, logprobs=lp)
        yield event("response.content_part.done", **where, part=final["output"][0]["content"][0])
        yield event("response.output_item.done", output_index=0, item=final["output"][0])
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(kind, response=final)
