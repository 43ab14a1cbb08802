"""Real agent clients against the real 0.5B through `specserve serve` (speculation on, the
default chain): the openai client's `parse`, instructor in tools mode, pydantic-ai agents
with a structured output and with a plain tool, and forced tool calls (one, or parallel);
every reply validates, and each request with speculation off in its body gives the same
text or calls (greedy: exactness is the contract). The plain-tool agent gets and runs a real
call, but the 0.5B never answers from the result (an expected failure, its reason below)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent, capture_run_messages
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.messages import ModelResponse, ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

from specserve.bench.server_process import MODEL_ID, ServerProcess, ServerSpec
from specserve.server.cli_args import DEFAULT_SPEC

PLAIN = {"speculative": {"types": []}}  # this request without speculation


class Transport(StrEnum):
    train = "train"
    plane = "plane"
    car = "car"


class Place(BaseModel):
    city: str
    country: str


class Trip(BaseModel):
    """Nested objects, an enum, a bounded integer and an optional field."""

    origin: Place
    destination: Place
    transport: Transport
    days: int = Field(ge=1, le=30)
    # free text is bounded, as a client that wants a short field says: the 0.5B, unbounded,
    # repeats a sentence until max_tokens
    note: str | None = Field(default=None, max_length=80)


class Ingredient(BaseModel):
    name: str
    grams: float = Field(gt=0, le=5000)


class Recipe(BaseModel):
    """An array of objects with bounded numbers."""

    title: str
    servings: int = Field(ge=1, le=12)
    ingredients: list[Ingredient] = Field(min_length=1, max_length=6)


class Review(BaseModel):
    """Bounded numbers, an array of strings and an optional field."""

    product: str
    stars: int = Field(ge=1, le=5)
    pros: list[str] = Field(max_length=3)
    verdict: str | None = Field(default=None, max_length=80)


SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (Trip, "Plan a 5 day trip by train from Paris, France to Rome, Italy."),
    (Recipe, "Give me a recipe for pancakes for 4 people with 3 ingredients."),
    (Review, "Review the Pixel 8 phone: great camera, good battery. 4 stars."),
]


@pytest.fixture(scope="module")
def served(qwen05_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The served 0.5B's /v1 address."""
    spec = ServerSpec(model=str(qwen05_path), slots=2, spec_type=DEFAULT_SPEC, threads=2)
    with ServerProcess(spec, tmp_path_factory.mktemp("agents") / "server.log") as server:
        yield server.url + "/v1"


@pytest.fixture()
def api(served: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=served, api_key="unused", max_retries=0, timeout=600)


def _ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


@pytest.mark.slow
@pytest.mark.parametrize("model, prompt", SCHEMAS, ids=[m.__name__ for m, _ in SCHEMAS])
def test_parse_returns_a_validated_object(api: openai.OpenAI, model, prompt: str) -> None:  # noqa: ANN001
    got = []
    for extra in ({}, PLAIN):
        try:
            reply = api.chat.completions.parse(
                model=MODEL_ID,
                messages=_ask(prompt),
                response_format=model,
                temperature=0,
                max_tokens=200,
                extra_body=extra,
            )
        except openai.LengthFinishReasonError as e:
            pytest.fail(f"cut off: {e.completion.choices[0].message.content!r}")
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, model), message.content
        got.append(message.content)
    assert got[0] == got[1]


@pytest.mark.slow
def test_instructor_tools_mode_returns_a_validated_object(api: openai.OpenAI) -> None:
    instructor = pytest.importorskip("instructor", reason="make setup-agents installs it")
    client = instructor.from_openai(api, mode=instructor.Mode.TOOLS)
    got = [
        client.chat.completions.create(
            model=MODEL_ID,
            response_model=Trip,
            messages=_ask(SCHEMAS[0][1]),
            temperature=0,
            max_tokens=200,
            max_retries=1,  # one attempt: a reply that does not validate fails the test
            extra_body=extra,
        )
        for extra in ({}, PLAIN)
    ]
    assert isinstance(got[0], Trip)
    # the fields: instructor keeps each raw response (its id, timings) as a private
    # attribute, which pydantic's == compares too
    assert got[0].model_dump() == got[1].model_dump()


def _agent_model(served: str) -> OpenAIChatModel:
    provider = OpenAIProvider(base_url=served, api_key="unused")
    return OpenAIChatModel(MODEL_ID, provider=provider)


@pytest.mark.slow
@pytest.mark.smoke
def test_pydantic_ai_structured_output(served: str) -> None:
    agent = Agent(_agent_model(served), output_type=Recipe, retries=0)
    got = [
        agent.run_sync(
            SCHEMAS[1][1],
            model_settings={"temperature": 0, "max_tokens": 200, "extra_body": extra},
        ).output
        for extra in ({}, PLAIN)
    ]
    assert isinstance(got[0], Recipe)
    assert got[0] == got[1]


def _order_agent(served: str, system_prompt: str = "") -> tuple[Agent, list[str]]:
    """An agent with one plain tool, as pydantic-ai's docs write one; the order ids the
    tool was asked about."""
    agent = Agent(_agent_model(served), system_prompt=system_prompt or (), retries=0)
    asked: list[str] = []

    @agent.tool_plain
    def get_order_status(order_id: str) -> str:
        """The shipping status of an order."""
        asked.append(order_id)
        return f"Order {order_id} shipped; tracking code ZX-4471."

    return agent, asked


ORDER_QUESTION = "What is the tracking code of order 8812?"
TOOL_SETTINGS: Any = {"temperature": 0, "max_tokens": 120}
ONE_REQUEST = UsageLimits(request_limit=1)


@pytest.mark.slow
def test_pydantic_ai_agent_gets_a_real_tool_call_and_runs_it(served: str) -> None:
    """tool_choice "auto": the 0.5B's first reply is a call (bare JSON, the grammar holding
    it to the tool's schema), which the agent runs."""
    agent, asked = _order_agent(served)
    with capture_run_messages() as messages, pytest.raises(UsageLimitExceeded):
        # the second request would be the answer; the 0.5B repeats its call there instead
        agent.run_sync(ORDER_QUESTION, model_settings=TOOL_SETTINGS, usage_limits=ONE_REQUEST)
    first = messages[1]
    assert isinstance(first, ModelResponse), messages
    (call,) = [p for p in first.parts if isinstance(p, ToolCallPart)]
    assert call.tool_name == "get_order_status" and call.args_as_dict() == {"order_id": "8812"}
    assert asked == ["8812"]


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="the 0.5B repeats its call after the tool's result: its next reply opens with "
    "{\" at p ~ 0.98 for every tool, prompt and result layout tried (the 1.5B's greedy "
    "reply repeats it too); nothing a server may do makes it answer",
)
def test_pydantic_ai_tool_runs_and_the_answer_uses_its_result(served: str) -> None:
    agent, asked = _order_agent(served)
    result = agent.run_sync(
        ORDER_QUESTION, model_settings=TOOL_SETTINGS, usage_limits=UsageLimits(request_limit=3)
    )
    assert asked == ["8812"], result.all_messages()
    assert "ZX-4471" in result.output, result.output


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PROMPTS = [
    "What is the weather in Paris?",
    "Is it raining in Tokyo right now? Use fahrenheit.",
    "How warm is it in Cairo?",
    "What time is it in New York?",
    "Tell me the current time in Europe/Berlin.",
    "Should I take an umbrella in London today?",
    "Weather for Sydney in celsius please.",
    "What's the local time in Asia/Kolkata?",
    "Is it cold in Oslo?",
    "hello",
]


def _calls(
    api: openai.OpenAI, prompt: str, choice: Any, extra: dict, parallel: bool = False
) -> list[tuple[str, str]]:
    reply = api.chat.completions.create(
        model=MODEL_ID,
        messages=_ask(prompt),
        tools=[WEATHER, CLOCK],
        tool_choice=choice,
        temperature=0,
        max_tokens=80,
        parallel_tool_calls=parallel,
        extra_body=extra,
    )
    choice0 = reply.choices[0]
    assert choice0.finish_reason == "tool_calls", choice0.message
    calls = choice0.message.tool_calls or []
    return [(c.function.name, c.function.arguments) for c in calls]  # type: ignore[union-attr]


def _valid(name: str, arguments: str) -> bool:
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[name]["function"]
    args = json.loads(arguments)
    required = tool["parameters"]["required"]  # type: ignore[index]
    return set(args) == set(required) and all(isinstance(args[k], str) for k in required)


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_choice_gives_a_valid_call_every_time(api: openai.OpenAI, choice) -> None:  # noqa: ANN001
    for prompt in PROMPTS:
        calls = _calls(api, prompt, choice, {})
        assert len(calls) == 1 and _valid(*calls[0]), (prompt, calls)
        if choice == NAMED:
            assert calls[0][0] == "get_time"
        assert [(n, a) for n, a in _calls(api, prompt, choice, PLAIN)] == calls, prompt


@pytest.mark.slow
def test_required_parallel_calls_end_with_valid_calls(api: openai.OpenAI) -> None:
    """With parallel calls allowed the 0.5B writes "</tool_call>\n" and then wants to end;
    the grammar lets it (before, it had to open call after call until max_tokens)."""
    for prompt in PROMPTS:
        calls = _calls(api, prompt, "required", {}, parallel=True)
        assert calls and all(_valid(*c) for c in calls), (prompt, calls)
        assert _calls(api, prompt, "required", PLAIN, parallel=True) == calls, prompt
