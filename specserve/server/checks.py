"""Checks of a request body before the engine sees it, each refused with a 400 that names
the field: fields that are not implemented, caps, and the sampling settings.

Every cap bounds work a request would otherwise make the server do per token or per step
for everyone: stop strings are scanned at every token, logit_bias and stop_token_ids are
applied at every step, and a prediction is searched whenever the output leaves it. The
body size itself is capped before parsing (server/transport.py).

    stop                 at most MAX_STOP strings of at most MAX_STOP_CHARS characters
                         (OpenAI allows 4)
    logit_bias           at most MAX_LOGIT_BIAS entries
    stop_token_ids       at most MAX_STOP_TOKEN_IDS ids
    tools                at most MAX_TOOLS (OpenAI's limit)
    prediction           at most the context's length in tokens
    n                    at least 1, at most MAX_N choices (each one decodes on its own)
"""

from __future__ import annotations

from typing import Any

from specserve.engine.sampling import SamplingParams
from specserve.server.errors import ApiError
from specserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ResponsesRequest,
)

MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_TOOLS = 128
MAX_N = 16


def check_caps(body: GenerationRequest) -> None:
    """Raise a 400 for the first field over its cap."""
    if body.choices < 1:
        raise ApiError(400, f"n must be at least 1, got {body.choices}", param="n")
    _at_most("n", body.choices, MAX_N, "choices")
    stop = body.stop_strings
    _at_most("stop", len(stop), MAX_STOP, "stop strings")
    longest = max(map(len, stop), default=0)
    _at_most("stop", longest, MAX_STOP_CHARS, "characters in a stop string")
    _at_most("logit_bias", len(body.logit_bias or {}), MAX_LOGIT_BIAS, "logit_bias entries")
    n_ids = len(body.stop_token_ids or [])
    _at_most("stop_token_ids", n_ids, MAX_STOP_TOKEN_IDS, "stop_token_ids")
    _at_most("tools", len(body.tools or []), MAX_TOOLS, "tools")
    _at_most("functions", len(body.functions or []), MAX_TOOLS, "functions")


def check_prediction(n_tokens: int, max_len: int) -> None:
    """A prediction longer than the context can never be repeated whole: refuse it."""
    _at_most("prediction", n_tokens, max_len, "prediction tokens (the context's length)")


def _at_most(param: str, got: int, cap: int, what: str) -> None:
    if got > cap:
        raise ApiError(400, f"{param}: at most {cap} {what}, got {got}", param=param)


def unsupported(body: GenerationRequest) -> None:
    """Refuse, naming it, a field that would change the output but is not implemented."""
    if body.functions and body.tool_choice != "none":
        raise ApiError(400, "functions are not supported; send tools", param="functions")
    if body.tools and body.tool_choice != "none" and not isinstance(body, ChatCompletionRequest):
        raise ApiError(
            400,
            "tools are supported on /v1/chat/completions only; leave them out, or send "
            'tool_choice "none"',
            param="tools",
        )
    if isinstance(body, ResponsesRequest) and body.choices != 1:
        raise ApiError(400, "n is not supported on /v1/responses (one output)", param="n")
    if isinstance(body, CompletionRequest):
        if body.best_of not in (None, 1):
            raise ApiError(400, f"best_of must be 1, got {body.best_of}", param="best_of")
        if body.suffix:
            raise ApiError(400, "suffix (insertion) is not supported", param="suffix")


def _logit_bias(asked: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias: its keys are token ids written as strings."""
    bias: dict[int, float] = {}
    for key, value in (asked or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise ApiError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    return bias


def sampling(body: GenerationRequest, max_tokens: int, top: int | None) -> SamplingParams:
    fields: dict[str, Any] = {
        name: getattr(body, name)
        for name in (
            "temperature", "top_p", "top_k", "min_p", "seed",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids",
        )
        if getattr(body, name) is not None
    }  # fmt: skip
    try:
        bias = _logit_bias(body.logit_bias)
        return SamplingParams(max_tokens=max_tokens, logit_bias=bias, logprobs=top, **fields)
    except ValueError as e:
        raise ApiError(400, str(e)) from e
