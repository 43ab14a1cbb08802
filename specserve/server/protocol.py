"""The HTTP API's shapes: OpenAI request and response bodies, plus llama.cpp's `timings`.

Requests accept (and ignore) fields we do not model, as OpenAI clients send many
(`user`, `metadata`, ...); fields we do model are type-checked, and a wrong type is a 400.
`n` samples several choices of one prompt, prefilled once (engine/samples.py); choice i
of a request with `seed` s uses seed s + i, so choice 0 is what the request with n = 1
gives. Fields that would change the output but are not implemented (`tools` outside chat,
`best_of`, `suffix`) are modelled only to be refused with a 400 that names them: ignoring
them would return text the client did not ask for. `response_format` (`json_object`,
`json_schema`; the Responses API spells it `text: {"format": ...}`) and the structured-output
extensions of vLLM and llama.cpp constrain the output to a grammar (server/structured.py).
Logprobs come in each endpoint's own shape: chat's `logprobs: true` + `top_logprobs`,
legacy completions' `logprobs: N`, the Responses API's
`include: ["message.output_text.logprobs"]` + `top_logprobs`.
Extensions beyond OpenAI (as vLLM and llama.cpp spell them): `top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `cache_prompt` (llama.cpp's: false prefills the
whole prompt even when its slot holds a prefix of it), `cache_salt` (vLLM's: prompt
prefixes, `cached_tokens` and the speculators' cross-request tables are shared only among
requests with the same salt, and with several API keys only among the same key's), and
`speculative`:

    "speculative": {"types": ["ngram-simple"], "n_max": 8, "n_min": 0, "p_min": 0.0}

where every field is optional, `types` picks among the server's `--spec-type` list and
`"types": []` turns speculation off for this request. OpenAI's `prediction` (Predicted
Outputs: `{"type": "content", "content": "..."}`) feeds the `prediction` drafter.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

# deeper JSON than this (tool arguments, schemas) is no real request, and a recursive reader
# of it (a template's tojson, json.loads) would run out of stack
MAX_JSON_DEPTH = 64
# a lone UTF-16 surrogate (JSON's "\ud800") is no character: no tokenizer or UTF-8 encoder
# takes it
_SURROGATE = re.compile("[\ud800-\udfff]")

# -- errors ---------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


# -- requests -------------------------------------------------------------------------------


class SpeculativeSettings(BaseModel):
    """Per-request speculative decoding; unset fields take the server's flags."""

    # a misspelt key here would silently leave speculation as it was: reject it
    model_config = ConfigDict(extra="forbid")

    types: list[str] | None = None
    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by the three generation endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None  # the legacy form of tools
    speculative: SpeculativeSettings | None = None
    prediction: Prediction | None = None
    cache_prompt: bool = True  # llama.cpp's: may start after the prefix its slot holds
    # vLLM's: requests share prompt prefixes and drafting knowledge only with those that send
    # the same salt (and, with several --api-key keys, the same key)
    cache_salt: str | None = Field(default=None, max_length=256)

    @property
    def choices(self) -> int:
        """How many choices to sample (OpenAI's n; choice i with seed s uses seed s + i)."""
        return 1 if self.n is None else self.n

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list, whether sent as one string or several."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @model_validator(mode="before")
    @classmethod
    def _plain_json(cls, data: Any) -> Any:
        check_plain_json(data)
        return data


def check_plain_json(data: Any) -> None:
    """Refuse (ValueError) JSON nested deeper than MAX_JSON_DEPTH or holding a lone surrogate
    in any string, key or value; iterative, so no input can exhaust the stack here."""
    todo: list[tuple[Any, int, str]] = [(data, 0, "")]
    while todo:
        value, depth, path = todo.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise ValueError(f"{path or 'body'}: a lone UTF-16 surrogate is not text")
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"{path or 'body'}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            name = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SURROGATE.search(key):
                raise ValueError(f"{path or 'body'}: a lone UTF-16 surrogate in a key")
            todo.append((item, depth + 1, name))


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a draft source)."""

    type: Literal["content"] = "content"
    content: str | list[ContentPart]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # the call a tool turn answers


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int]
    # OpenAI's legacy completions default to 16 tokens
    max_tokens: int | None = 16
    echo: bool = False  # the prompt's text comes first in the choice's text
    best_of: int | None = None
    suffix: str | None = None


class ResponsesInputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]


class ResponsesText(BaseModel):
    """The Responses API's text settings: `format` is its response_format."""

    model_config = ConfigDict(extra="allow")

    format: ResponseFormat | None = None


class ResponsesRequest(GenerationRequest):
    input: str | list[ResponsesInputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: ResponsesText | None = None

    include: list[str] | None = None  # "message.output_text.logprobs" asks for logprobs


# -- responses ------------------------------------------------------------------------------


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
