"""OpenAI's JSON mode through the server (tiny model, char tokenizer): the text is a JSON
object or, cut by max_tokens, a prefix of one; the same streamed, and with drafts."""

from __future__ import annotations

import json

import httpx2

from tests.server.conftest import MODEL_ID, LiveServer
from tests.server.test_openai_api import HELLO, client
from tests.tiny import constraint


def json_prefix(text: str) -> bool:
    """Whether text is a JSON object or a prefix of one (the char tokenizer: id = ord)."""
    ids = [ord(c) for c in text]
    return constraint("json_object").valid_prefix(ids) == len(ids)


JSON = {"type": "json_object"}
# the tiny model closes the object at once ("{}"): "}" banned, its replies run long
NO_CLOSE = {str(ord("}")): -100}
KW = dict(model=MODEL_ID, messages=HELLO, temperature=0, response_format=JSON)


def test_json_mode_text_is_json_streaming_or_not(live: LiveServer) -> None:
    c = client(live).chat.completions
    kw = {**KW, "max_tokens": 40, "logit_bias": NO_CLOSE}
    plain = c.create(**{**kw, "response_format": {"type": "text"}})  # type: ignore[call-overload]
    got = c.create(**kw)  # type: ignore[call-overload]
    text = got.choices[0].message.content
    assert text != plain.choices[0].message.content  # the grammar changed the reply
    assert len(text) > 20 and json_prefix(text), text
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.create(**kw, stream=True)  # type: ignore[call-overload]
        if ch.choices
    )
    assert streamed == text
    closed = c.create(**KW, max_tokens=40).choices[0]  # type: ignore[call-overload]
    assert json.loads(closed.message.content) == {} and closed.finish_reason == "stop"


def test_json_mode_with_drafts_equals_without(live: LiveServer, drafting: LiveServer) -> None:
    kw = {**KW, "max_tokens": 120, "logit_bias": NO_CLOSE}
    want = client(live).chat.completions.create(**kw)  # type: ignore[call-overload]
    got = client(drafting).chat.completions.create(**kw)  # type: ignore[call-overload]
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.timings["draft_n_accepted"] > 0  # type: ignore[attr-defined]


def test_responses_api_spells_json_mode_as_text_format(live: LiveServer) -> None:
    kw = {**KW, "max_tokens": 40, "logit_bias": NO_CLOSE}
    chat = client(live).chat.completions.create(**kw)  # type: ignore[call-overload]
    body = {
        "input": "hello",
        "temperature": 0,
        "max_output_tokens": 40,
        "logit_bias": NO_CLOSE,
        "text": {"format": {"type": "json_object"}},
    }
    got = httpx2.post(live.url + "/v1/responses", json=body, timeout=60).json()
    assert got["output"][0]["content"][0]["text"] == chat.choices[0].message.content
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["yes", "no"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    got = httpx2.post(live.url + "/v1/responses", json=body, timeout=60).json()
    assert json.loads(got["output"][0]["content"][0]["text"])["a"] in ("yes", "no")
