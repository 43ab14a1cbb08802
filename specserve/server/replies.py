"""The HTTP API's response bodies: OpenAI's chat, completions and Responses objects and
their stream chunks, with usage and logprobs in each endpoint's shape (request bodies are in
server/protocol.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's: prompt tokens served from the prompt cache
    prompt_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})


class TopLogprob(BaseModel):
    """A token at one position and its log-probability (`bytes`: the token's own bytes)."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobs(TopLogprob):
    """An emitted token with the most likely tokens at its position (chat, Responses)."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobs]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions' logprobs: parallel lists, text_offset in characters of the text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDelta(BaseModel):
    name: str | None = None  # in a call's first delta only
    arguments: str = ""  # a fragment of the JSON text


class ToolCallDelta(BaseModel):
    """A piece of a call in a stream chunk, as OpenAI streams them: the first carries `id`,
    `type` and the name, the later ones fragments of the arguments; `index` counts the
    response's calls."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body = {k: v for k, v in handler(self).items() if v is not None}
        body["function"] = {k: v for k, v in body["function"].items() if v is not None}
        return body


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: dict[str, float | int] | None = None


class ChatDelta(BaseModel):
    """A stream chunk's delta: OpenAI sends only the fields a chunk carries ({} at the end)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChunkSpeculation(BaseModel):
    """Our extension on each streamed chunk of generated text: the tokens behind it, how
    many of them were accepted draft tokens, and the speculator type that proposed those."""

    tokens: int
    drafted: int = 0
    type: str | None = None


def joined(a: ChunkSpeculation | None, b: ChunkSpeculation | None) -> ChunkSpeculation | None:
    """The tokens behind two pieces of text sent as one; the types of the drafters whose
    tokens they hold, in order, comma-separated."""
    if a is None or b is None:
        return a or b
    types = [t for t in (a.type, b.type) if t]
    return ChunkSpeculation(
        tokens=a.tokens + b.tokens,
        drafted=a.drafted + b.drafted,
        type=",".join(dict.fromkeys(t for ts in types for t in ts.split(","))) or None,
    )


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timings: dict[str, float | int] | None = None
    speculative: ChunkSpeculation | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A legacy completion; streamed chunks have the same shape (OpenAI's convention)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: dict[str, float | int] | None = None
    speculative: ChunkSpeculation | None = None  # streamed chunks only


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprobs] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ResponsesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputMessage]
    usage: ResponsesUsage | None = None
    incomplete_details: dict[str, str] | None = None
    error: ErrorDetail | None = None
    timings: dict[str, float | int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
