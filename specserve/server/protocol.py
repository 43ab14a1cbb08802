"""The HTTP API's request bodies (OpenAI's, with extensions); responses are in server/replies.py.

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
    model_validator,
)

# deeper JSON than this (tool arguments, schemas) is no real request, and a recursive reader
# of it (a template's tojson, json.loads) would run out of stack
MAX_JSON_DEPTH = 64
# a lone UTF-16 surrogate (JSON's "\ud800") is no character: no tokenizer or UTF-8 encoder
# takes it
_SURROGATE = re.compile("[\ud800-\udfff]")

# -- requests -------------------------------------------------------------------------------


class SpeculativeSettings(BaseModel):
    """Per-request speculative decoding; unset fields take the server's flags."""

    # a misspelt key here would silently leave speculation as it was: reject it
    model_config = ConfigDict(extra="forbid")

    types: list[str] | None = None
    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    alternatives: int | None = None  # a head's runners-up per draft token (0: none)


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
