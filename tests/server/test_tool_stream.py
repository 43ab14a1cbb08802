"""Streamed tool calls in OpenAI's incremental form: a call's first delta carries its id and
name, the later ones fragments of its arguments, and they put together what the whole
reply holds."""

from __future__ import annotations

import json

import pytest

from specserve.server.replies import ToolCallDelta
from specserve.server.tools import ToolCallStream
from tests.server.conftest import MODEL_ID, LiveServer
from tests.server.test_openai_api import client
from tests.server.test_structured import CITY, CLOCK
from tests.server.test_tools import ASK, NAMES, tooled  # noqa: F401 (a fixture)

TRICKY = {"q": 'a "}" b \\', "n": [1, {"x": "{"}], "e": {}}


def _assemble(parts: list[ToolCallDelta]) -> dict[int, list[str | None]]:
    """index -> [id, name, arguments] as a client accumulates them."""
    calls: dict[int, list[str | None]] = {}
    for p in parts:
        if p.index not in calls:
            assert p.id and p.function.name and p.function.arguments == "", p
            calls[p.index] = [p.id, p.function.name, ""]
        else:
            assert p.id is None and p.function.name is None and p.function.arguments, p
            calls[p.index][2] = (calls[p.index][2] or "") + p.function.arguments
    return calls


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_arguments_stream_in_fragments_to_their_closing_brace(piece: int) -> None:
    arguments = json.dumps(TRICKY)
    text = (
        f'Ok.<tool_call>\n{{"name": "search", "arguments": {arguments}}}\n</tool_call>'
        '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
    )
    stream, parts = ToolCallStream(NAMES), []
    content = ""
    for i in range(0, len(text), piece):
        content += stream.push(text[i : i + piece])[0]
        parts += stream.take_parts()
    content += stream.flush()[0]
    parts += stream.take_parts()
    assert content == "Ok."
    got = _assemble(parts)
    assert [(c.id, c.function.name, c.function.arguments) for c in stream.calls] == [
        tuple(got[0]),
        tuple(got[1]),
    ]
    assert json.loads(got[0][2] or "") == TRICKY and json.loads(got[1][2] or "") == {"city": "Oslo"}
    fragments = [p for p in parts if p.index == 0 and p.id is None]
    # grown as the text came: a char at a time, a fragment per char; all at once, one
    want = {1: len(arguments), 1000: 1}.get(piece)
    assert (len(fragments) == want) if want else (len(fragments) > 1)
    # the other layout is sent whole when it closes: its start, then its arguments
    assert len([p for p in parts if p.index == 1 and p.id is None]) == 1


def test_a_cut_off_call_is_content_as_in_the_whole_reply() -> None:
    stream = ToolCallStream(NAMES)
    content, calls = stream.push('<tool_call>{"name": "search", "arguments": {"q": "ra')
    assert (content, calls) == ("", []) and stream.take_parts()  # begun in the stream
    rest, calls = stream.flush()
    assert rest == '<tool_call>{"name": "search", "arguments": {"q": "ra' and calls == []


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_streamed_deltas_rebuild_the_non_streamed_calls(tooled: LiveServer, tool_choice) -> None:  # noqa: ANN001, F811
    c = client(tooled).chat.completions
    kw = dict(
        model=MODEL_ID,
        messages=ASK,
        tools=[CITY, CLOCK],
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0,
    )
    whole = c.create(**kw).choices[0].message  # type: ignore[call-overload]
    want = [(t.function.name, t.function.arguments) for t in whole.tool_calls or []]
    assert want and whole.content is None
    with c.stream(**kw) as stream:  # type: ignore[call-overload]
        final = stream.get_final_completion()
    got = final.choices[0].message
    assert [(t.function.name, t.function.arguments) for t in got.tool_calls or []] == want
    assert final.choices[0].finish_reason == "tool_calls" and not got.content
    chunks = c.create(**kw, stream=True)  # type: ignore[call-overload]
    parts = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    assembled = _assemble(parts)  # type: ignore[arg-type]
    assert [(n, a) for _, n, a in assembled.values()] == want
    for index, (_, _, arguments) in assembled.items():
        fragments = [p for p in parts if p.index == index and p.id is None]
        assert arguments == "{}" or len(fragments) > 1, fragments
