"""The `speculative` field of streamed chunks: how many of a chunk's tokens came from
accepted drafts, and from which speculator type (server/runs.py, server/streams.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx2
import pytest

from specserve.engine.request import Request
from specserve.engine.sampling import SamplingParams
from specserve.loading.model import LoadedModel
from specserve.server.events import Event
from specserve.server.replies import ChunkSpeculation
from specserve.server.runs import text_run
from specserve.server.streams import Delta, Finish
from specserve.server.text import TextStream
from specserve.server.tools import with_calls
from tests.server.conftest import LiveServer, start_server
from tests.server.test_tools import CALL

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def predicting(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    """The prediction drafter alone: every accepted draft token is its."""
    server = start_server(tiny_model, parallel=1, spec_types=("prediction",))
    yield server
    server.stop()


def chunks(server: LiveServer, path: str = CHAT, **body: object) -> list[dict]:
    body = {"messages": HELLO, "temperature": 0, "stream": True, **body}
    with httpx2.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def text_of(got: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in got if c["choices"])


def test_chunks_count_the_drafted_tokens_the_timings_count(
    live: LiveServer, predicting: LiveServer
) -> None:
    """A prediction that covers the first half of the reply: drafts stop where it ends, so
    no step's draft is cut by max_tokens and the chunks' drafted tokens add up to the
    timings' accepted count; every chunk's tokens add up to the completion tokens."""
    plain = text_of(chunks(live, max_tokens=60))
    hint = {"type": "content", "content": plain[:30]}
    got = chunks(predicting, max_tokens=60, prediction=hint, stream_options={"include_usage": True})
    assert text_of(got) == plain
    specs = [c["speculative"] for c in got if c.get("speculative")]
    timings, usage = got[-2]["timings"], got[-1]["usage"]
    drafted = sum(s["drafted"] for s in specs)
    assert drafted == timings["draft_n_accepted"] >= 20
    assert sum(s["tokens"] for s in specs) == usage["completion_tokens"] == 60
    assert {s["type"] for s in specs if s["drafted"]} == {"prediction"}
    assert all(0 <= s["drafted"] <= s["tokens"] for s in specs)
    assert all(s["type"] is None for s in specs if not s["drafted"])


def test_a_chain_names_the_drafter_whose_tokens_were_kept(
    live: LiveServer, drafting: LiveServer
) -> None:
    """Without a prediction, the chain's accepted drafts come from n-grams or suffixes; the
    text is the one without speculation; a step cut by max_tokens counts only what it kept."""
    plain = text_of(chunks(live, max_tokens=80))
    got = chunks(drafting, max_tokens=80)
    assert text_of(got) == plain
    specs = [c["speculative"] for c in got if c.get("speculative")]
    drafted = sum(s["drafted"] for s in specs)
    assert 0 < drafted <= got[-1]["timings"]["draft_n_accepted"]
    assert {s["type"] for s in specs if s["drafted"]} <= {"ngram-map-k", "suffix"}
    assert sum(s["tokens"] for s in specs) == 80


def test_completions_and_responses_streams_carry_the_field_too(drafting: LiveServer) -> None:
    got = chunks(drafting, "/v1/completions", prompt="hello", max_tokens=40)
    assert sum(c["speculative"]["tokens"] for c in got if c.get("speculative")) == 40
    body = {"input": "hello", "max_output_tokens": 40, "temperature": 0, "stream": True}
    with httpx2.stream("POST", drafting.url + "/v1/responses", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert sum(e["speculative"]["tokens"] for e in deltas) == 40


class _Steps:
    """A handle whose engine emits these steps: (text, drafted, by), a character a token."""

    def __init__(self, steps: list[tuple[str, int, str]]) -> None:
        self.request = Request([1], SamplingParams())
        self.steps = steps

    async def events(self):  # noqa: ANN201
        for n, (text, drafted, by) in enumerate(self.steps, 1):
            event = Event([ord(c) for c in text], n == len(self.steps), "length", {})
            event.drafted, event.drafted_by = drafted, by
            yield event

    def cancel(self) -> None:
        pass


def test_a_steps_drafts_and_own_token_go_out_apart(tiny_model: LoadedModel) -> None:
    """A step's accepted drafts and the target's own token are separate deltas; text held
    back (here: a possible start of the stop string "xy") is counted where it goes out."""
    tok = tiny_model.tokenizer
    assert tok is not None
    handle = _Steps([("abcd", 3, "suffix"), ("x", 0, ""), ("zf", 1, "ngram-map-k"), ("g", 0, "")])

    async def run() -> list:
        stream = TextStream(tok.decode, ["xy"])
        return [x async for x in text_run(handle, stream, None)]  # type: ignore[arg-type]

    *deltas, fin = asyncio.run(run())
    got = [(d.text, d.origin.tokens, d.origin.drafted, d.origin.type) for d in deltas]
    assert got == [
        ("abc", 3, 3, "suffix"),
        ("d", 1, 0, None),
        ("xz", 2, 1, "ngram-map-k"),  # "x" was held back: it might have started "xy"
        ("f", 1, 0, None),
        ("g", 1, 0, None),
    ]
    assert fin.completion_tokens == 8 == sum(d.origin.tokens for d in deltas)


def test_the_tool_filter_sends_the_tokens_behind_text_it_held_back() -> None:
    """With tools offered the text goes through the tool filter, which holds back a call
    until it can send it: the tokens behind held text go out with the next piece sent."""
    pieces = [
        ("<tool_call>" + CALL[:20], ChunkSpeculation(tokens=3, drafted=2, type="suffix")),
        (CALL[20:], ChunkSpeculation(tokens=4)),
        ("</tool_call>\n", ChunkSpeculation(tokens=2, drafted=1, type="ngram-map-k")),
    ]

    async def run() -> list:
        async def deltas():  # noqa: ANN202
            for text, origin in pieces:
                yield Delta(text, origin=origin)
            yield Finish("stop", 1, 9, {})

        return [x async for x in with_calls(deltas(), ["get_weather"])]

    *out, fin = asyncio.run(run())
    assert fin.reason == "tool_calls" and not "".join(d.text for d in out)
    assert [c.function.name for d in out for c in d.calls] == ["get_weather"]
    assert sum(d.origin.tokens for d in out) == 9 and sum(d.origin.drafted for d in out) == 3
    types = {t for d in out if d.origin.type for t in d.origin.type.split(",")}
    assert types == {"suffix", "ngram-map-k"}
