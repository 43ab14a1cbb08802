"""Bad requests to the OpenAI-compatible server: each is an HTTP 4xx with an OpenAI error body
(message, type, param, code), and the `openai` client raises its typed error for it."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL_ID, LiveServer
from tests.server.test_openai_api import CHAT, HELLO, client, post

BAD_INPUTS = {
    "malformed-json": (CHAT, b'{"model": "tiny", "messages": [', 400, "malformed JSON body"),
    "messages-not-a-list": (
        CHAT,
        {"messages": "hi"},
        400,
        "messages: Input should be a valid list",
    ),
    "messages-missing": (CHAT, {"model": MODEL_ID}, 400, "messages: Field required"),
    "body-not-an-object": (CHAT, b"[1, 2]", 400, "the body must be a JSON object"),
    "temperature-a-string": (CHAT, {"messages": HELLO, "temperature": "hot"}, 400, "temperature:"),
    "max-tokens-zero": (
        CHAT,
        {"messages": HELLO, "max_tokens": 0},
        400,
        "max_tokens must be at least 1, got 0",
    ),
    "max-tokens-beyond-context": (
        CHAT,
        {"messages": HELLO, "max_tokens": 1000},
        400,
        "max_tokens can be at most 489, got 1000",
    ),
    "max-output-tokens-beyond-context": (
        "/v1/responses",
        {"input": "hello", "max_output_tokens": 1000},
        400,
        "max_output_tokens can be at most",
    ),
    "prompt-longer-than-context": (
        "/v1/completions",
        {"prompt": "x" * 600},
        400,
        "the prompt has 600 tokens; the context holds 512",
    ),
    "prompt-longer-than-context-streaming": (
        "/v1/completions",
        {"prompt": "x" * 600, "stream": True},
        400,
        "the prompt has 600 tokens; the context holds 512",
    ),
    "empty-prompt": ("/v1/completions", {"prompt": ""}, 400, "the prompt is empty"),
    "token-id-out-of-vocab": (
        "/v1/completions",
        {"prompt": [5, 999]},
        400,
        "prompt token ids must be in [0, 128)",
    ),
    "unknown-model": (
        CHAT,
        {"model": "gpt-9", "messages": HELLO},
        404,
        "The model `gpt-9` does not exist",
    ),
    "top-p-out-of-range": (CHAT, {"messages": HELLO, "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    "n-over-the-cap": (CHAT, {"messages": HELLO, "n": 17}, 400, "n: at most 16 choices, got 17"),
    "n-zero": ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n must be at least 1, got 0"),
    "n-on-responses": ("/v1/responses", {"input": "hi", "n": 2}, 400, "n is not supported"),
    "speculative-type-not-enabled": (
        CHAT,
        {"messages": HELLO, "speculative": {"types": ["ngram-simple"]}},
        400,
        "are not enabled",
    ),
    "speculative-min-above-max": (
        CHAT,
        {"messages": HELLO, "speculative": {"n_max": 2, "n_min": 5}},
        400,
        "need 0 <= draft-min <= draft-max",
    ),
    "speculative-negative-alternatives": (
        CHAT,
        {"messages": HELLO, "speculative": {"alternatives": -1}},
        400,
        "draft alternatives must be >= 0",
    ),
    "speculative-unknown-key": (
        CHAT,
        {"messages": HELLO, "speculative": {"nmax": 4}},
        400,
        "speculative.nmax: Extra inputs",
    ),
    "image-content": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "only text content",
    ),
    # fields that would change the output, not implemented: refused, never ignored
    "json-schema-response-format": (
        CHAT,
        {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "response_format: json_schema needs a schema object",
    ),
    "tools-without-a-tool-template": (
        CHAT,
        {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "this model's chat template has no tool calls",
    ),
    "tools-on-completions": (
        "/v1/completions",
        {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools are supported on /v1/chat/completions only",
    ),
    "legacy-functions": (
        CHAT,
        {"messages": HELLO, "functions": [{"name": "f"}]},
        400,
        "send tools",
    ),
    "best-of": ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of must be 1"),
    "suffix": ("/v1/completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix (insertion)"),
    "logit-bias-key-not-an-id": (
        CHAT,
        {"messages": HELLO, "logit_bias": {"hello": 5}},
        400,
        "logit_bias keys must be token ids, got 'hello'",
    ),
    "logit-bias-id-out-of-vocab": (
        CHAT,
        {"messages": HELLO, "logit_bias": {"500": 5}},
        400,
        "logit_bias token ids must be < 128, got [500]",
    ),
    "logit-bias-too-big": (
        CHAT,
        {"messages": HELLO, "logit_bias": {"65": 150}},
        400,
        "logit_bias values must be in [-100, 100]",
    ),
}


@pytest.mark.parametrize("path, body, status, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_an_openai_error(
    live: LiveServer, path: str, body: dict | bytes, status: int, message: str
) -> None:
    got = post(live, path, body)
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"


def test_client_raises_typed_errors(live: LiveServer) -> None:
    c = client(live)
    with pytest.raises(openai.NotFoundError) as not_found:
        c.chat.completions.create(model="gpt-9", messages=HELLO)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        c.completions.create(model=MODEL_ID, prompt="hi", max_tokens=0)
