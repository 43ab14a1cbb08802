"""Tool calls out of generated text: tagged blocks anywhere, a bare call only as the whole
reply, nothing lost when it is no call; streaming in any pieces equals the whole."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator

import httpx2
import pytest

from specserve.loading.model import LoadedModel
from specserve.loading.tokenizer import Tokenizer
from specserve.server.streams import Delta, Finish
from specserve.server.tools import ToolCallStream, split, template_message, with_calls
from tests.server.conftest import MODEL_ID, LiveServer, start_server
from tests.server.test_openai_api import client

NAMES = ["get_weather", "search"]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def calls_of(text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = split(text, NAMES)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]


PARIS = [("get_weather", {"city": "Paris"})]
CASES = {
    "tagged": (f"<tool_call>\n{CALL}\n</tool_call>", ("", PARIS)),
    "text-then-two-calls": (
        f"Let me look.\n<tool_call>{CALL}</tool_call><tool_call>"
        '{"name": "search", "arguments": {"q": "rain"}}</tool_call>',
        ("Let me look.\n", [*PARIS, ("search", {"q": "rain"})]),
    ),
    # the line breaks between and after calls are no content; text after a call is
    "calls-on-lines": (
        f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>\n",
        ("", PARIS * 2),
    ),
    "a-call-then-text": (f"<tool_call>{CALL}</tool_call>\n Done.", ("\n Done.", PARIS)),
    "bare": (CALL, ("", PARIS)),
    "bare-in-a-json-fence": (f"```json\n{CALL}\n```", ("", PARIS)),
    "plain": ("Paris is sunny.", ("Paris is sunny.", [])),
}
# not calls: the text comes back as it was
NOT_CALLS = {
    "bare-tool-not-offered": '{"name": "rm", "arguments": {}}',
    "bare-then-more-text": CALL + "\nDone.",
    "json-in-a-python-fence": f"```python\nx = {CALL}\n```",
    "tagged-bad-json": "<tool_call>{oops</tool_call> ok",
    "tagged-unclosed": f"<tool_call>{CALL}",
    "a-lookalike-tag": "a <tool_x> b",
}
CASES.update({name: (text, (text, [])) for name, text in NOT_CALLS.items()})


@pytest.mark.parametrize("text, want", CASES.values(), ids=CASES.keys())
def test_whole_reply(text: str, want: tuple) -> None:
    assert calls_of(text) == want


@pytest.mark.parametrize("text", [c[0] for c in CASES.values()], ids=CASES.keys())
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_in_pieces_equals_whole(text: str, piece: int) -> None:
    stream = ToolCallStream(NAMES)
    content, calls = "", []
    for i in range(0, len(text), piece):
        got, made = stream.push(text[i : i + piece])
        content, calls = content + got, calls + made
    rest, made = stream.flush()
    content, calls = content + rest, calls + made
    assert (content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]) == (
        calls_of(text)
    )
    assert stream.calls == calls


def test_plain_text_streams_at_once_and_a_bare_call_waits_for_the_end() -> None:
    stream = ToolCallStream(NAMES)
    assert stream.push("Sure, <tool") == ("Sure, ", [])  # a possible tag held back
    assert stream.push("box> here") == ("<toolbox> here", [])
    bare = ToolCallStream(NAMES)
    assert bare.push('{"name": "get_weather",') == ("", [])
    assert bare.push(' "arguments": {}}') == ("", [])
    rest, calls = bare.flush()
    assert rest == "" and [c.function.arguments for c in calls] == ["{}"]
    assert len({c.id for c in stream.calls + calls}) == len(stream.calls + calls)


def test_a_call_turn_reaches_the_template_with_its_arguments_as_an_object() -> None:
    turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],  # fmt: skip
    }
    assert template_message(turn)["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert turn["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the input stays
    assert template_message({"role": "user", "content": "hi"}) == {"role": "user", "content": "hi"}


# -- through the server: a tiny model whose template offers tools ----------------------------

TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}"
    "</tools>reply<tool_call>|{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
ASK = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def tooled(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    assert tiny_model.tokenizer is not None
    hf = copy.deepcopy(tiny_model.tokenizer.hf)
    hf.chat_template = TOOLS_TEMPLATE
    server = start_server(dataclasses.replace(tiny_model, tokenizer=Tokenizer(hf)))
    yield server
    server.stop()


def test_tools_reach_the_prompt_and_a_reply_without_calls_is_content(tooled: LiveServer) -> None:
    c = client(tooled).chat.completions
    kw = dict(model=MODEL_ID, messages=ASK, max_tokens=12, temperature=0)
    plain = c.create(**kw)  # type: ignore[call-overload]
    offered = c.create(**kw, tools=WEATHER)  # type: ignore[call-overload]
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens
    # the tiny model writes no call: its text is the content, finished as usual
    text = offered.choices[0].message.content
    assert text and offered.choices[0].message.tool_calls is None
    assert offered.choices[0].finish_reason == "length"
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.create(**kw, tools=WEATHER, stream=True)  # type: ignore[call-overload]
        if ch.choices
    )
    assert streamed == text
    # a follow-up turn carries the call and its answer
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    call = {"id": "c1", "type": "function", "function": function}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    turn.append({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
    again = c.create(**{**kw, "messages": turn}, tools=WEATHER)  # type: ignore[call-overload]
    assert again.usage.prompt_tokens > offered.usage.prompt_tokens + len("get_weather{city:Paris}")


TOOL_ERRORS = {
    "unknown-choice": ({"tool_choice": "sometimes"}, 'tool_choice is "none", "auto"'),
    "unknown-named-tool": (
        {"tool_choice": {"type": "function", "function": {"name": "rm"}}},
        "tool_choice names a tool",
    ),
    "format-beside-tools": (
        {"response_format": {"type": "json_object"}},
        "response_format and tools together",
    ),
    "not-a-function": ({"tools": [{"type": "function"}]}, "each tool must be"),
}


@pytest.mark.parametrize("extra, message", TOOL_ERRORS.values(), ids=TOOL_ERRORS.keys())
def test_bad_tool_settings_are_400(tooled: LiveServer, extra: dict, message: str) -> None:
    body = {"messages": ASK, "tools": WEATHER, **extra}
    got = httpx2.post(tooled.url + "/v1/chat/completions", json=body, timeout=30)
    assert got.status_code == 400, got.text
    assert message in got.json()["error"]["message"]


def test_calls_leave_the_text_and_finish_the_reply(tiny_model: LoadedModel) -> None:
    """What the server does with a reply that makes calls (the tiny model writes none):
    the calls come out of the stream, and a reply that stopped finishes with tool_calls."""
    handle = _Replies([f"Checking. <tool_call>{CALL[:20]}", f"{CALL[20:]}</tool_call>"])

    async def run() -> list:
        return [x async for x in with_calls(handle.run(), NAMES)]

    *deltas, fin = asyncio.run(run())
    assert "".join(d.text for d in deltas) == "Checking. "
    assert [c.function.name for d in deltas for c in d.calls] == ["get_weather"]
    assert fin.reason == "tool_calls"


class _Replies:
    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    async def run(self) -> AsyncIterator[Delta | Finish]:
        for piece in self.pieces:
            yield Delta(piece)
        yield Finish("stop", 1, 2, {})


def test_streamed_calls_are_chunks_with_an_index_and_the_reply_is_null_content() -> None:
    """The SSE chunks and the whole response a reply with two calls becomes."""
    from specserve.server import choices, streams

    ids = streams.Ids("chatcmpl-x", MODEL_ID)
    handle = _Replies([f"<tool_call>{CALL}</tool_call>", f"<tool_call>{CALL}</tool_call>"])

    async def run() -> list:
        return [x async for x in with_calls(handle.run(), NAMES)]

    items = asyncio.run(run())
    *deltas, fin = items

    async def sse() -> list[str]:
        async def again() -> AsyncIterator[Delta | Finish]:
            for item in items:
                yield item

        runs = choices.merged([again()])
        return [line async for line in streams.chat(ids, runs, 1, include_usage=False)]

    chunks = [json.loads(c[len("data: ") :]) for c in asyncio.run(sse()) if "[DONE]" not in c]
    sent = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    calls = [c for d in deltas for c in d.calls]
    starts = [(d["index"], d["id"], d["function"]["name"]) for d in sent if "id" in d]
    assert starts == [(n, c.id, "get_weather") for n, c in enumerate(calls)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = streams.chat_completion(ids, [(Delta.join(deltas), fin)])["choices"][0]
    assert whole["message"]["content"] is None and len(whole["message"]["tool_calls"]) == 2
