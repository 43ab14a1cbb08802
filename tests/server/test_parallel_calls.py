"""Parallel calls under tool_choice "required" end: after each call's line break the
reply may end, so a model that wants to stop there stops (tiny float64 model whose
tokenizer spells a line break, steered by logit_bias to want exactly that)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest

from specserve.loading.model import LoadedModel
from specserve.loading.tokenizer import Tokenizer, load_tokenizer
from tests.server.conftest import MODEL_ID, LiveServer, start_server
from tests.server.test_openai_api import client
from tests.server.test_structured import CITY, CLOCK
from tests.server.test_tools import ASK, TOOLS_TEMPLATE
from tests.tiny import write_tokenizer


@pytest.fixture(scope="module")
def lined(
    tiny_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, Tokenizer]]:
    """The tools server on the tiny model, its char tokenizer spelling a line break."""
    folder = tmp_path_factory.mktemp("lined")
    write_tokenizer(folder, line_break=True)
    tok = load_tokenizer(folder)
    tok.hf.chat_template = TOOLS_TEMPLATE
    server = start_server(
        dataclasses.replace(tiny_model, tokenizer=tok), spec_types=("ngram-map-k",)
    )
    yield server, tok
    server.stop()


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "plain"])
def test_required_parallel_calls_end_after_a_line_break(lined, speculative: bool) -> None:  # noqa: ANN001
    server, tok = lined
    (newline,) = tok.encode_text("\n")
    (end,) = tok.eog_ids
    # the model most wants a line break, then the end: as Qwen's 0.5B does after a call
    bias = {str(newline): 60, str(end): 30}
    extra = {} if speculative else {"speculative": {"types": []}}
    kw: Any = dict(
        model=MODEL_ID,
        messages=ASK,
        tools=[CITY, CLOCK],
        tool_choice="required",
        temperature=0,
        max_tokens=300,
        logit_bias=bias,
        extra_body=extra,
    )
    c = client(server).chat.completions
    choice = c.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
    assert len(calls) >= 1 and choice.message.content is None
    for name, arguments in calls:
        args = json.loads(arguments)
        assert name == "get_time" or args["city"] in ("Paris", "Rome")
    # streamed: the line breaks between and after calls are no content deltas either
    chunks = list(c.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # each chunk still says which tokens are behind it, though the filter rewrote the text
    specs = [s for ch in chunks if (s := (ch.model_extra or {}).get("speculative"))]
    assert sum(s["tokens"] for s in specs) == chunks[-1].usage.completion_tokens  # type: ignore[union-attr]
    if speculative:
        assert sum(s["drafted"] for s in specs) > 0
    with c.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == calls
