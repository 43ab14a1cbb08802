"""Structured replies on the real 0.5B: a tool call (its chat template offers the tool, and
the reply it writes, a bare call without Qwen's <tool_call> tags, comes out as the call),
and JSON mode (the reply parses, the same with speculation as without)."""

from __future__ import annotations

import json

import pytest

from specserve.engine.request import Request, SpecParams
from specserve.engine.sampling import SamplingParams
from specserve.engine.setup import EngineSettings, build_engine
from specserve.grammar.constraint import build_constraint
from specserve.grammar.formats import Grammar
from specserve.server.tools import split

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.mark.slow
@pytest.mark.smoke
def test_weather_question_becomes_a_call_qwen05(qwen05_auto, real_threads) -> None:  # noqa: ANN001
    tok = qwen05_auto.tokenizer
    ask = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    prompt = tok.chat(ask, [WEATHER])
    assert len(prompt) > len(tok.chat(ask)) + 40  # the tool's description is in the prompt
    engine, _ = build_engine(EngineSettings(ctx_size=len(prompt) + 64), target=qwen05_auto)
    params = SamplingParams(temperature=0, max_tokens=48)
    req = Request(prompt, params, SpecParams(n_max=0), stop_ids=tok.eog_ids)
    engine.generate([req])
    content, calls = split(tok.decode(req.output), ["get_weather"])
    assert content == "" and len(calls) == 1, tok.decode(req.output)
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.slow
@pytest.mark.smoke
def test_json_mode_reply_parses_with_speculation_or_not_qwen05(qwen05_auto, real_threads) -> None:  # noqa: ANN001
    tok = qwen05_auto.tokenizer
    ask = "Describe Paris as a JSON object with keys name, country and population."
    prompt = tok.chat([{"role": "user", "content": ask}])
    outputs = []
    for types in ((), ("ngram-map-k", "suffix")):
        settings = EngineSettings(ctx_size=len(prompt) + 96, spec_types=types)
        engine, _ = build_engine(settings, target=qwen05_auto)
        engine.cost.measure = False  # drafts by the fixed prior: verified on a busy machine too
        params = SamplingParams(temperature=0, max_tokens=80)
        req = Request(prompt, params, SpecParams(n_max=16), stop_ids=tok.eog_ids)
        req.constraint = build_constraint(
            tok, qwen05_auto.cfg.vocab_size, Grammar("json_object", None)
        )
        engine.generate([req])
        outputs.append(req.output)
    assert engine.speculator is not None and engine.speculator.stats.tokens_accepted > 0
    assert outputs[0] == outputs[1]
    reply = json.loads(tok.decode(outputs[0]))
    assert reply["name"] == "Paris" and reply["country"] == "France"
