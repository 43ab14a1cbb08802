"""Logprobs through the server, in each endpoint's shape (tiny float64 model, char tokenizer:
a token is one character, so the tokens spell the text)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx2
import pytest

from specserve.engine.logprobs import TokenLogprob
from specserve.engine.request import Request
from specserve.engine.sampling import SamplingParams
from specserve.loading.model import LoadedModel
from specserve.server.events import Event
from specserve.server.runs import text_run
from specserve.server.text import TextStream
from tests.server.conftest import MODEL_ID, LiveServer, chat_text
from tests.server.test_openai_api import HELLO, client

CHAT = "/v1/chat/completions"
GREEDY = dict(model=MODEL_ID, temperature=0, max_tokens=24)


def _items(got: list) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(i.token, i.logprob, [(t.token, t.logprob) for t in i.top_logprobs]) for i in got]


def assert_same(got: list, want: list) -> None:
    """The same tokens and top tokens, the same figures to float64 rounding: a row's logits
    may come from another batch shape (the prompt cache feeds one prompt token, a verify
    step several), bit for bit the same only with --deterministic."""

    def tokens(items: list) -> list:
        return [(token, [t for t, _ in top]) for token, _, top in items]

    def values(items: list) -> list[float]:
        return [v for _, logprob, top in items for v in (logprob, *(x for _, x in top))]

    assert tokens(got) == tokens(want)
    assert values(got) == pytest.approx(values(want), abs=1e-9)


def chat_logprobs(server: LiveServer, stream: bool = False, **kw: object) -> tuple[str, list]:
    """The text and its (token, logprob, top) items, streamed or not."""
    args = {**GREEDY, "messages": HELLO, "logprobs": True, "top_logprobs": 3, **kw}
    c = client(server).chat.completions
    if not stream:
        choice = c.create(**args).choices[0]  # type: ignore[call-overload]
        return choice.message.content, _items(choice.logprobs.content)
    text, items = "", []
    for chunk in c.create(**args, stream=True):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].logprobs:
            items += _items(chunk.choices[0].logprobs.content)
        text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    return text, items


def test_chat_logprobs_spell_the_text_streaming_or_not(live: LiveServer) -> None:
    text, items = chat_logprobs(live)
    assert len(items) == 24 and "".join(t for t, _, _ in items) == text
    for token, logprob, top in items:  # greedy: the token is the most likely one
        assert len(top) == 3 and top[0] == (token, logprob) and logprob <= 0
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    streamed, again = chat_logprobs(live, stream=True)
    assert streamed == text
    assert_same(again, items)
    raw = client(live).chat.completions.create(messages=HELLO, logprobs=True, **GREEDY)
    first = raw.choices[0].logprobs.content[0]
    assert first.top_logprobs == [] and first.bytes == list(first.token.encode())
    plain = client(live).chat.completions.create(messages=HELLO, **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


def test_completion_logprobs_are_the_legacy_lists(live: LiveServer) -> None:
    _, items = chat_logprobs(live)
    kw = dict(**GREEDY, prompt=chat_text(HELLO), logprobs=2)
    out = client(live).completions.create(**kw)  # type: ignore[call-overload]
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    tops = [list(top.items()) for top in lp.top_logprobs]
    as_items = list(zip(lp.tokens, lp.token_logprobs, tops, strict=True))
    assert_same(as_items, [(t, v, top[:2]) for t, v, top in items])
    # where each token starts in the text (an unused id spells nothing)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(24)]
    chunks = [c.choices[0].logprobs for c in client(live).completions.create(**kw, stream=True)]
    got = [c for c in chunks if c is not None]
    assert [t for c in got for t in c.tokens] == lp.tokens
    assert [o for c in got for o in c.text_offset] == lp.text_offset


def test_responses_logprobs_come_with_include(live: LiveServer) -> None:
    _, items = chat_logprobs(live)
    kw = dict(model=MODEL_ID, input="hello", max_output_tokens=24, temperature=0, top_logprobs=3)
    include = ["message.output_text.logprobs"]
    out = client(live).responses.create(**kw, include=include)  # type: ignore[arg-type]
    assert_same(_items(out.output[0].content[0].logprobs), items)
    events = list(client(live).responses.create(**kw, include=include, stream=True))  # type: ignore[arg-type]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert_same(_items([i for e in deltas for i in e.logprobs]), items)
    assert_same(_items(events[-1].response.output[0].content[0].logprobs), items)


def test_stop_string_ends_the_logprobs_at_its_token(live: LiveServer) -> None:
    """The tokens up to the one that completes the stop string, as many as usage counts."""
    text, items = chat_logprobs(live, max_tokens=30)
    stop = text[8:10]
    cut = text.index(stop)
    got = client(live).chat.completions.create(
        messages=HELLO, logprobs=True, stop=[stop], **{**GREEDY, "max_tokens": 30}
    )
    tokens = [i.token for i in got.choices[0].logprobs.content]
    assert got.choices[0].message.content == text[:cut]
    assert "".join(tokens) == text[: cut + len(stop)]
    assert got.usage.completion_tokens == len(tokens)


def test_logprobs_with_drafts_equal_without(live: LiveServer, drafting: LiveServer) -> None:
    """Verification rows give each token what a one-token step gives (to float64 rounding
    here; to the bit with --deterministic, tests/speculative/test_exactness.py), and a stop string
    found inside a multi-token step ends the tokens where plain decoding ends them."""
    text, items = chat_logprobs(live, max_tokens=60)
    hint = {"prediction": {"type": "content", "content": text}}
    got = client(drafting).chat.completions.create(
        messages=HELLO,
        logprobs=True,
        top_logprobs=3,
        extra_body=hint,
        **{**GREEDY, "max_tokens": 60},
    )
    assert got.timings["draft_n_accepted"] >= 30  # type: ignore[attr-defined]
    assert got.choices[0].message.content == text
    assert_same(_items(got.choices[0].logprobs.content), items)
    stop = text[30:32]
    kw = dict(messages=HELLO, logprobs=True, stop=[stop], extra_body=hint, **GREEDY)
    stopped = [
        client(s).chat.completions.create(**{**kw, "max_tokens": 60}) for s in (live, drafting)
    ]
    plain, fast = ([i.token for i in out.choices[0].logprobs.content] for out in stopped)
    assert fast == plain and stop[-1] == plain[-1]
    assert stopped[1].choices[0].message.content == text[: text.index(stop)]
    assert [out.usage.completion_tokens for out in stopped] == [len(plain)] * 2
    assert stopped[1].timings["draft_n_accepted"] > 0  # type: ignore[attr-defined]


class _Steps:
    """A handle whose engine emits these steps' tokens (a verified draft: several a step)."""

    def __init__(self, steps: list[str]) -> None:
        self.request = Request([1], SamplingParams())
        self.steps = [[ord(c) for c in step] for step in steps]
        self.cancelled = False

    async def events(self) -> AsyncIterator[Event]:
        for n, tokens in enumerate(self.steps, 1):
            lp = [TokenLogprob(t, -t / 100) for t in tokens]
            yield Event(tokens, n == len(self.steps), "length", {}, logprobs=lp)

    def cancel(self) -> None:
        self.cancelled = True


def test_a_stop_string_inside_a_step_ends_the_tokens_at_its_own(tiny_model: LoadedModel) -> None:
    """Text, token count and logprobs end at the token that completes the stop string, as
    they do when the tokens come one a step, not at the end of its step."""
    tok = tiny_model.tokenizer
    assert tok is not None
    handle = _Steps(["a", "bc|de", "f"])

    async def run() -> list:
        return [x async for x in text_run(handle, TextStream(tok.decode, ["c|"]), tok)]  # type: ignore[arg-type]

    *deltas, fin = asyncio.run(run())
    assert "".join(d.text for d in deltas) == "ab"
    got = [(i.token, i.logprob) for d in deltas for i in d.logprobs]
    assert got == [(c, -ord(c) / 100) for c in "abc|"]
    assert (fin.reason, fin.completion_tokens, handle.cancelled) == ("stop", 4, True)


COMP, RESP = "/v1/completions", "/v1/responses"
BAD = {
    "chat-top-without-logprobs": (CHAT, {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    "chat-top-too-many": (CHAT, {"logprobs": True, "top_logprobs": 21}, "must be in [0, 20]"),
    "chat-logprobs-number": (CHAT, {"logprobs": 3}, "logprobs must be true or false"),
    "completion-logprobs-true": (COMP, {"logprobs": True}, "must be an integer"),
    "completion-top-logprobs": (COMP, {"top_logprobs": 2}, "not top_logprobs"),
    "completion-logprobs-negative": (COMP, {"logprobs": -1}, "logprobs must be in [0, 20]"),
    "completion-echo": (COMP, {"logprobs": 1, "echo": True}, "with echo"),
    "responses-logprobs": (RESP, {"logprobs": True}, "takes include"),
    "responses-top-too-many": (RESP, {"top_logprobs": 30}, "top_logprobs must be in"),
}
BASE = {CHAT: {"messages": HELLO}, COMP: {"prompt": "hi"}, RESP: {"input": "hi"}}


@pytest.mark.parametrize("path, body, message", BAD.values(), ids=BAD.keys())
def test_bad_logprobs_settings_are_400(
    live: LiveServer, path: str, body: dict, message: str
) -> None:
    got = httpx2.post(live.url + path, json={**BASE[path], **body}, timeout=30)
    assert got.status_code == 400, got.text
    assert message in got.json()["error"]["message"]
