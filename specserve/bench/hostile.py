"""Bad and extreme requests, as a hostile client sends them, and the answers each may get.

One table serves the hostile-input tests (tests/server/test_hostile.py) and the load
benchmark's hostile client (`specserve bench serve --load --hostile N`): every case gets a
4xx with OpenAI's error body or a correct answer, never a 5xx, and never costs another
client its answer.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# (path, body as an object or as raw JSON text, the statuses it may get)
Case = tuple[str, dict[str, Any] | str, frozenset[int]]
OK, BAD = frozenset({200}), frozenset({400})
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HUGE_TEXT = "tell me more " * 160_000  # ~2 MB: far more tokens than any context here
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"a": value}
    return value


def _tool_turn(function: Any) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def hostile_cases(model: str) -> dict[str, Case]:
    """Every case by name, for a server that serves `model` (a chat model)."""

    def chat(**fields: Any) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}

    deep_arguments = {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}
    return {
        "top_k-2**63": (CHAT, chat(top_k=2**63, max_tokens=4), OK),
        "temperature-5e-324": (CHAT, chat(temperature=5e-324, max_tokens=4), OK),
        "top_p-1e-45": (CHAT, chat(top_p=1e-45, max_tokens=4), OK),
        "top_k-2**64": (CHAT, chat(top_k=2**64, max_tokens=4), OK | BAD),
        "seed-2**200": (CHAT, chat(seed=2**200, max_tokens=4), OK),
        "temperature-negative": (CHAT, chat(temperature=-1), BAD),
        "temperature-infinity": (CHAT, '{"temperature": Infinity}', BAD),
        "max_tokens-2**70": (CHAT, chat(max_tokens=2**70), BAD),
        "top_logprobs-2**70": (CHAT, chat(logprobs=True, top_logprobs=2**70), BAD),
        "logit_bias-beyond-vocab": (CHAT, chat(logit_bias={"99999999": 5}), BAD),
        "logit_bias-2000-entries": (CHAT, chat(logit_bias={str(i): 1 for i in range(2000)}), BAD),
        "stop-2000-long-strings": (CHAT, chat(stop=["x" * 256] * 2000), BAD),
        "stop-16-long-strings": (
            CHAT,
            chat(stop=[chr(65 + i) * 256 for i in range(16)], max_tokens=30),
            OK,
        ),
        "stop_token_ids-huge": (CHAT, chat(stop_token_ids=[2**70], max_tokens=8), OK | BAD),
        "prediction-2MB": (
            CHAT,
            chat(prediction={"type": "content", "content": HUGE_TEXT}, max_tokens=4),
            BAD,
        ),
        "prompt-2MB": (COMPLETIONS, {"model": model, "prompt": HUGE_TEXT}, BAD),
        "surrogate-in-content": (
            CHAT,
            chat(messages=[{"role": "user", "content": "a\ud800b"}]),
            BAD,
        ),
        "surrogate-in-model": (CHAT, {**chat(), "model": "\udfff"}, BAD),
        "surrogate-in-key": (CHAT, {**chat(), "x\ud800": 1}, BAD),
        "tool_calls-function-a-string": (
            CHAT,
            chat(messages=[{"role": "user", "content": "hi"}, _tool_turn("f(1)")]),
            BAD,
        ),
        "tool-arguments-nested-100000": (
            CHAT,
            chat(messages=[_tool_turn(deep_arguments)], tools=[TOOL]),
            BAD,
        ),
        "body-nested-100": (CHAT, chat(metadata=_nested(100)), BAD),
        "body-nested-100000": (CHAT, '{"a":' * 100_000 + "1" + "}" * 100_000, BAD),
        "tools-200": (CHAT, chat(tools=[TOOL] * 200), BAD),
        "malformed-json": (CHAT, '{"model": ', BAD),
        "not-an-object": (CHAT, "[1, 2, 3]", BAD),
        "n-2**63": (CHAT, chat(n=2**63), BAD),
        "unknown-speculator": (CHAT, chat(speculative={"types": ["nope"]}), BAD),
        "image-part": (
            CHAT,
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            BAD,
        ),
        "prompt-ids-beyond-vocab": (COMPLETIONS, {"model": model, "prompt": [1, 10**9]}, BAD),
        "empty-messages": (CHAT, chat(messages=[]), BAD),
    }


def encode(body: dict[str, Any] | str) -> bytes:
    """A case's body as sent (json.dumps writes a lone surrogate as its \\u escape)."""
    return (body if isinstance(body, str) else json.dumps(body)).encode()


@dataclass
class HostileRun:
    """What a hostile client got: statuses by case, and the answers it should not have."""

    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)  # "case: status" outside its allowed set


async def hostile_client(
    url: str, model: str, deadline: float, every_s: float = 1.0, seed: int = 0
) -> HostileRun:
    """Send one random case every `every_s` seconds until `deadline` (time.monotonic)."""
    import httpx2  # the openai client's HTTP library: a dev dependency, as the benchmarks'

    cases = hostile_cases(model)
    names = sorted(cases)
    rng = random.Random(seed)
    run = HostileRun()
    headers = {"Content-Type": "application/json"}
    async with httpx2.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            started = time.monotonic()
            name = rng.choice(names)
            path, body, allowed = cases[name]
            try:
                answer = await client.post(path, content=encode(body), headers=headers)
            except httpx2.HTTPError as e:
                run.wrong.append(f"{name}: {type(e).__name__}")
                continue
            run.sent += 1
            run.statuses[answer.status_code] += 1
            if answer.status_code not in allowed:
                run.wrong.append(f"{name}: {answer.status_code}")
            await asyncio.sleep(max(0.0, every_s - (time.monotonic() - started)))
    return run
