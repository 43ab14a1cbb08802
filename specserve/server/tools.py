"""Tool calls in chat: the tools go into the chat template, the calls come out of the text.

Qwen2.5's template (and every Hermes-style one) asks the model to answer a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallStream` takes the generated text delta by delta and splits it into plain content
and complete calls (vLLM's `hermes` parser reads the same format). Text that may be the
start of `<tool_call>` is held back until it is clearly not, as stop strings are; a block
whose JSON does not parse as a call, or that never closes, is handed back as content, so
no generated text is lost.

A stream sends each call as OpenAI does: first its id and name, then its arguments in
fragments as the text arrives. The tools' grammar holds a tagged call to one layout,
`{"name": ..., "arguments": {...}}`, so the name is known once its string closes, and the
arguments object ends where its braces balance (outside strings). A call that was begun in a
stream but is cut off (max_tokens) before its tag closes is handed back as content too, as
the whole reply would hand it back; a call in another layout, or a bare one, is sent at
once in two pieces, its start and its arguments whole.

Qwen2.5-Coder 0.5B and 1.5B leave the tags out: asked for the weather with a weather tool
offered, they answer `{"name": "get_weather", "arguments": {"city": "Paris"}}`, bare or in
a ```json fence. So a reply that is, as a whole, one such object naming an offered tool is
a call too. Only the whole reply: llama.cpp's Hermes parser, which takes JSON anywhere,
turned sample code into calls of tools that do not exist (llama.cpp #18183). A reply that
starts like one (`{`, ```json) is therefore held back until it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from specserve.server.errors import ApiError
from specserve.server.protocol import ChatCompletionRequest, check_plain_json
from specserve.server.replies import (
    ChunkSpeculation,
    FunctionCall,
    FunctionDelta,
    ToolCall,
    ToolCallDelta,
    joined,
)
from specserve.server.streams import Delta, Finish
from specserve.server.text import partial_prefix

START, END = "<tool_call>", "</tool_call>"


def offered(body: ChatCompletionRequest, chat_template: str | None) -> list[Any] | None:
    """The tools to offer the model: none unless asked, or with tool_choice "none"."""
    if not body.tools or body.tool_choice == "none":
        return None
    if isinstance(body.tool_choice, str) and body.tool_choice not in ("auto", "required"):
        raise ApiError(
            400,
            f'tool_choice is "none", "auto", "required" or a named function, got '
            f"{body.tool_choice!r}",
            param="tool_choice",
        )
    if not chat_template or START not in chat_template:
        raise ApiError(400, "this model's chat template has no tool calls", param="tools")
    for tool in body.tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(
                400,
                'each tool must be {"type": "function", "function": {"name": ..., ...}}',
                param="tools",
            )
    return body.tools


async def with_calls(
    run: AsyncIterator[Delta | Finish], names: list[str]
) -> AsyncIterator[Delta | Finish]:
    """A run with the calls taken out of its text; a reply that made calls and stopped by
    itself finishes with "tool_calls", as OpenAI's do."""
    calls = ToolCallStream(names)
    held: ChunkSpeculation | None = None  # the tokens behind text held back, not yet sent
    async for item in run:
        if isinstance(item, Delta):
            text, made = calls.push(item.text)
            parts = calls.take_parts()
            held = joined(held, item.origin)
            if text or made or parts or item.logprobs:
                yield Delta(text, item.logprobs, made, parts, held)
                held = None
            continue
        rest, made = calls.flush()
        parts = calls.take_parts()
        if rest or made or parts or held:
            yield Delta(rest, None, made, parts, held)
        if calls.calls and item.reason == "stop":
            item = dataclasses.replace(item, reason="tool_calls")
        yield item


# a tagged call's start as the grammar lays it out, up to its arguments' opening brace
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclasses.dataclass
class _Open:
    """A tagged call whose start a stream has sent: where its arguments begin in the block,
    how far they are sent, and the scanner's state there."""

    index: int
    id: str
    name: str
    start: int
    sent: int
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    done: bool = False

    def grow(self, block: str) -> str:
        """The arguments' text that `block` adds, up to their closing brace."""
        i = self.sent
        while i < len(block) and not self.done:
            c = block[i]
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped = c == "\\"
                self.in_string = c != '"'
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.done = self.depth == 0
            i += 1
        piece, self.sent = block[self.sent : i], i
        return piece


class ToolCallStream:
    def __init__(self, names: Sequence[str]) -> None:
        self._names = set(names)  # the offered tools: what a bare reply may call
        self._text = ""  # received, not yet handed out
        self._inside = False  # within a <tool_call> block
        self._bare = True  # the reply so far may, as a whole, be a bare call
        self._open: _Open | None = None  # the tagged call being streamed
        self._parts: list[ToolCallDelta] = []  # pieces of calls not yet taken
        self._started = 0  # calls whose start has been sent
        self._after_call = False  # only white space since the last tagged call closed
        self.calls: list[ToolCall] = []

    def take_parts(self) -> list[ToolCallDelta]:
        """The pieces of calls that the text so far began or grew, for a stream."""
        parts, self._parts = self._parts, []
        return parts

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        """New text -> (content that is safe to emit, calls completed by it)."""
        self._text += delta
        if self._bare:
            self._bare = _may_be_bare(self._text)
            if self._bare:
                return "", []
        return self._split()

    def flush(self) -> tuple[str, list[ToolCall]]:
        """The generation ended: the rest of the content (an unclosed block as written),
        and a bare call if the whole reply was one."""
        if self._bare:
            self._bare = False
            call = _parse(_unfenced(self._text), self._names)
            if call is not None:
                self._text = ""
                self.calls.append(self._send_whole(call))
                return "", [call]
        content, calls = self._split()
        if self._after_call and not self._inside and not self._text.strip():
            self._text = ""  # the line breaks after the last call are no content
        rest = (START if self._inside else "") + self._text
        self._text, self._inside, self._open = "", False, None
        return content + rest, calls

    def _split(self) -> tuple[str, list[ToolCall]]:
        content = ""
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                end = self._text.find(END)
                self._grow(self._text if end < 0 else self._text[:end])
                if end < 0:
                    return content, calls
                block, self._text = self._text[:end], self._text[end + len(END) :]
                self._inside = False
                call = _parse(block)
                if call is None:  # not a call after all: the text as it was
                    content += START + block + END
                else:
                    calls.append(self._finish(call, block))
                    self.calls.append(calls[-1])
                    self._after_call = True
                self._open = None
                continue
            start = self._text.find(START)
            upto = start if start >= 0 else len(self._text) - partial_prefix(self._text, START)
            piece = self._text[:upto]
            # white space after a call waits: it is content only if text follows
            if self._after_call and not piece.strip():
                if start < 0:
                    return content, calls
                piece = ""
            self._after_call = False
            content += piece
            if start < 0:
                self._text = self._text[upto:]
                return content, calls
            self._text = self._text[start + len(START) :]
            self._inside = True

    def _grow(self, block: str) -> None:
        """Send the start of the tagged call in `block` once its name is known, and then
        what its arguments gained."""
        if self._open is None:
            head = _HEAD.match(block)
            if head is None:
                return
            try:
                name = json.loads(f'"{head[1]}"')
            except json.JSONDecodeError:  # no name after all: sent whole when it closes
                return
            self._open = _Open(self._started, _call_id(), name, head.end(), head.end())
            self._started += 1
            self._parts.append(_start_part(self._open.index, self._open.id, name))
        piece = self._open.grow(block)
        if piece:
            self._parts.append(
                ToolCallDelta(index=self._open.index, function=FunctionDelta(arguments=piece))
            )

    def _finish(self, call: ToolCall, block: str) -> ToolCall:
        """The closed call, as its pieces were sent: their id, and its arguments as written."""
        if self._open is None or not self._open.done:
            return self._send_whole(call)
        arguments = block[self._open.start : self._open.sent]
        return ToolCall(
            id=self._open.id, function=FunctionCall(name=self._open.name, arguments=arguments)
        )

    def _send_whole(self, call: ToolCall) -> ToolCall:
        index, self._started = self._started, self._started + 1
        self._parts.append(_start_part(index, call.id, call.function.name))
        if call.function.arguments:
            arguments = FunctionDelta(arguments=call.function.arguments)
            self._parts.append(ToolCallDelta(index=index, function=arguments))
        return call


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _start_part(index: int, call_id: str, name: str) -> ToolCallDelta:
    return ToolCallDelta(
        index=index, id=call_id, type="function", function=FunctionDelta(name=name)
    )


def split(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]]:
    """A whole reply -> (content, calls)."""
    stream = ToolCallStream(names)
    content, calls = stream.push(text)
    rest, more = stream.flush()
    return content + rest, calls + more


_FENCE = "```json"


def _may_be_bare(text: str) -> bool:
    """Whether a reply that starts with `text` may still be one bare call as a whole."""
    t = text.lstrip()
    if t.startswith(_FENCE):
        t = t[len(_FENCE) :].lstrip()
    elif _FENCE.startswith(t):
        return True
    return t == "" or t.startswith("{")


def _unfenced(text: str) -> str:
    t = text.strip()
    if t.startswith(_FENCE) and t.endswith("```"):
        return t[len(_FENCE) : -3]
    return t


def _parse(block: str, names: set[str] | None = None) -> ToolCall | None:
    """A call's JSON -> the call; None if it is none (or, with `names`, not a bare call of
    an offered tool with its arguments)."""
    try:
        body = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    if names is not None and (body["name"] not in names or "arguments" not in body):
        return None
    arguments = body.get("arguments", body.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(id=_call_id(), function=FunctionCall(name=body["name"], arguments=text))


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI assistant message with tool_calls as templates read it: arguments as an
    object (OpenAI sends a JSON string; Qwen's template writes it with `tojson`)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(
                400,
                'each tool call must be {"id": ..., "type": "function", "function": {"name": '
                '..., "arguments": "..."}}',
                param="messages.tool_calls",
            )
        function = dict(function)
        # an object already, or text that is no JSON: the template writes it as it is
        with contextlib.suppress(TypeError, json.JSONDecodeError):
            function["arguments"] = _loads_bounded(function.get("arguments") or "{}")
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}


def _loads_bounded(text: str) -> Any:
    """json.loads, refusing what is nested too deep for the template to write back."""
    try:
        value = json.loads(text)
        check_plain_json(value)
    except (RecursionError, ValueError) as e:
        if isinstance(e, json.JSONDecodeError):
            raise
        raise ApiError(400, f"tool call arguments: {e}", param="messages.tool_calls") from None
    return value
