"""Structured outputs through the server (tiny float64 model, char tokenizer): every
spelling of a format constrains the reply, a format the library cannot compile is a 400
quoting its reason, drafts leave the text as it was, and forced tool calls are calls."""

from __future__ import annotations

import json
import re

import httpx2
import pytest

from tests.server.conftest import MODEL_ID, LiveServer
from tests.server.test_openai_api import HELLO, client
from tests.server.test_tools import ASK, tooled  # noqa: F401 (a fixture)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["sun", "rain"]}, "maxItems": 3},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["city", "days", "tags"],
    "additionalProperties": False,
}
REGEX = r"id-[0-9]{3}: (ok|late)"
CHOICES = ["alpha beta", "gamma", "delta epsilon zeta"]
GBNF = 'root ::= "n=" [0-9]{2} ("," [a-c])*'


def check_schema(text: str) -> None:
    got = json.loads(text)
    assert got["city"] in SCHEMA["properties"]["city"]["enum"] and 1 <= got["days"] <= 9
    assert set(got) <= set(SCHEMA["properties"]) and len(got["tags"]) <= 3


# each spelling -> a check of its reply
SPELLINGS = {
    "response_format-json_schema": (
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}},
        check_schema,
    ),
    "structured_outputs-json": ({"structured_outputs": {"json": SCHEMA}}, check_schema),
    "guided_json": ({"guided_json": SCHEMA}, check_schema),
    "llama-json_schema": ({"json_schema": SCHEMA}, check_schema),
    "guided_regex": ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "structured_outputs-regex": (
        {"structured_outputs": {"regex": REGEX}},
        lambda t: re.fullmatch(REGEX, t) or pytest.fail(t),
    ),
    "guided_choice": ({"guided_choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(t)),
    "structured_outputs-choice": (
        {"structured_outputs": {"choice": CHOICES}},
        lambda t: t in CHOICES or pytest.fail(t),
    ),
    "llama-grammar-gbnf": (
        {"grammar": GBNF},
        lambda t: re.fullmatch(r"n=[0-9]{2}(,[a-c])*", t) or pytest.fail(t),
    ),
    "guided_grammar-lark": (
        {"guided_grammar": 'start: "k" /[0-9]/ "!"'},
        lambda t: re.fullmatch(r"k[0-9]!", t) or pytest.fail(t),
    ),
}  # fmt: skip


@pytest.mark.parametrize("extra, check", SPELLINGS.values(), ids=SPELLINGS.keys())
def test_each_spelling_constrains_the_reply(live: LiveServer, extra: dict, check) -> None:  # noqa: ANN001
    body = {"model": MODEL_ID, "messages": HELLO, "temperature": 0, "max_tokens": 200, **extra}
    got = httpx2.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    check(choice["message"]["content"])


def test_completions_and_sampling_follow_the_grammar_too(live: LiveServer) -> None:
    for seed in range(3):
        body = {"prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": seed}
        got = httpx2.post(live.url + "/v1/completions", json={**body, "guided_regex": REGEX})
        assert re.fullmatch(REGEX, got.json()["choices"][0]["text"]), got.text


REFUSED = {
    "bad-schema": ({"guided_json": {"type": "strin"}}, "strin"),
    "bad-regex": ({"guided_regex": "[0-9]+("}, "unclosed group"),
    "bad-grammar": ({"grammar": "root ::= (("}, "grammar"),
    "two-formats": (
        {"response_format": {"type": "json_object"}, "guided_regex": "a"},
        "ask for one output format",
    ),
    "empty-choice": ({"guided_choice": []}, None),
    "no-schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"
    ),
    "unknown-format": ({"response_format": {"type": "yaml"}}, "not supported"),
}  # fmt: skip


@pytest.mark.parametrize("extra, words", REFUSED.values(), ids=REFUSED.keys())
def test_a_format_that_cannot_compile_is_400(live: LiveServer, extra: dict, words) -> None:  # noqa: ANN001
    body = {"messages": HELLO, "max_tokens": 5, **extra}
    got = httpx2.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    if not extra.get("guided_choice", True):  # an empty list is no format asked for
        assert got.status_code == 200
        return
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["type"] and (words is None or words in error["message"]), error


@pytest.mark.parametrize("extra", [SPELLINGS["guided_json"][0], SPELLINGS["guided_choice"][0]])
def test_drafts_leave_constrained_text_as_it_was(
    live: LiveServer, drafting: LiveServer, extra: dict
) -> None:  # noqa: E501
    kw = {"messages": HELLO, "temperature": 0, "max_tokens": 200, **extra}
    want = httpx2.post(live.url + "/v1/chat/completions", json=kw, timeout=60).json()
    got = httpx2.post(drafting.url + "/v1/chat/completions", json=kw, timeout=60).json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    # the schema's keys and the choices' tails are forced runs: drafted and kept
    assert got["timings"]["draft_n_accepted"] > 0
    assert want["timings"]["draft_n"] == 0


CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_tool_choice_gives_a_valid_call(tooled: LiveServer, tool_choice) -> None:  # noqa: ANN001, F811
    c = client(tooled).chat.completions
    kw = dict(
        model=MODEL_ID,
        messages=ASK,
        tools=[CITY, CLOCK],
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0,
    )
    got = c.create(**kw)  # type: ignore[call-overload]
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time" and args == {}
    else:
        assert call.function.name in ("get_weather", "get_time")
        assert call.function.name == "get_time" or args["city"] in ("Paris", "Rome")
    # streamed, and put together by the openai client's own stream helper: the same call
    with c.stream(**kw) as stream:  # type: ignore[call-overload]
        final = stream.get_final_completion()
    (again,) = final.choices[0].message.tool_calls
    assert (again.function.name, again.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )


def test_tool_parameters_with_defs_refs_compile_and_bind(tooled: LiveServer) -> None:  # noqa: F811
    """pydantic writes a nested model as a "$ref" to the parameters' own "$defs": they
    point from the document's root, so the calls' grammar must keep them reachable."""
    place = {"type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"]}
    params = {
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/Place"}},
        "required": ["to"],
        "additionalProperties": False,
        "$defs": {"Place": {**place, "additionalProperties": False}},
    }
    trip = {"type": "function", "function": {"name": "trip", "parameters": params}}
    got = client(tooled).chat.completions.create(
        model=MODEL_ID,
        messages=ASK,
        tools=[trip, CLOCK],
        tool_choice={"type": "function", "function": {"name": "trip"}},
        max_tokens=120,
        temperature=0,
    )
    (call,) = got.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == {"to": {"city": "Oslo"}}
    clash = {
        **trip,
        "function": {"name": "other", "parameters": {**params, "$defs": {"Place": place}}},
    }
    bad = httpx2.post(
        tooled.url + "/v1/chat/completions",
        json={"messages": ASK, "tools": [trip, clash], "tool_choice": "required"},
        timeout=30,
    )
    assert bad.status_code == 400 and "$defs/Place" in bad.json()["error"]["message"], bad.text
