"""The serving benchmarks' clients: N concurrent OpenAI streaming chat clients, greedy.

Each client sends its requests one after another (a closed loop: a new request when the
last one finished), so N clients keep at most N requests in the server at once. Client c's
i-th request takes prompt (c + N * i) mod len(PROMPTS): no prompt repeats within a run of
up to len(PROMPTS) requests, which matters because greedy outputs of a repeated prompt are
identical and the suffix speculator, which learns from earlier outputs, would draft them
perfectly and flatter speculation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specserve.bench.server_process import MODEL_ID
from specserve.errors import SpecserveError

if TYPE_CHECKING:
    import openai

PROMPTS: tuple[str, ...] = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a quicksort in C.",
    "Implement binary search over a sorted slice in Rust.",
    "Write a JavaScript debounce function with a cancel method.",
    "Write a SQL query that returns the 5 customers with the largest total order amount.",
    "Write a Python class for an LRU cache with get and put in O(1).",
    "Write a Go function that reverses a singly linked list.",
    "Write a bash script that counts the lines of every .py file under a directory.",
    "Write a TypeScript function that deep-merges two objects.",
    "Write a Java method that checks whether parentheses in a string are balanced.",
    "Write a C++ class for a fixed-size ring buffer.",
    "Write a Python generator that yields the Fibonacci numbers.",
    "Write a Python function that parses a CSV line with quoted fields.",
    "Write a Rust function that counts word frequencies in a string.",
    "Write a Python decorator that retries a function up to 3 times on exception.",
    "Write a C function that computes the CRC32 of a byte buffer.",
)


@dataclass(frozen=True)
class Workload:
    """What the clients send: how many, how much, and for how long."""

    clients: int = 4
    requests_per_client: int = 4  # the count bound; in load mode a cap besides the time
    max_tokens: int = 128
    duration_s: float | None = None  # load mode: no new request after this many seconds
    timeout_s: float = 600.0  # one request, first byte to last

    def __post_init__(self) -> None:
        if self.clients < 1 or self.requests_per_client < 1 or self.max_tokens < 1:
            raise ValueError("clients, requests per client and max tokens must be >= 1")


@dataclass
class RequestResult:
    """One request as a client saw it; `error` is set when it failed (tokens then count 0)."""

    client: int
    prompt: int
    tokens: int = 0
    ttft_s: float | None = None  # request sent -> first content token (queueing included)
    latency_s: float = 0.0
    error: str | None = None
    text: str = ""  # the answer's content, as streamed


@dataclass
class RunResult:
    """All requests of one run and the wall time from the first send to the last token."""

    requests: list[RequestResult]
    wall_s: float

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def errors(self) -> int:
        return sum(r.error is not None for r in self.requests)


def _api(url: str, timeout: float) -> openai.AsyncOpenAI:
    """A client that never retries: a failure is counted, not hidden behind a retry."""
    try:
        import openai  # a dev dependency: imported here so `specserve --help` needs none
    except ImportError as e:
        raise SpecserveError("the serving benchmarks need `pip install openai`") from e
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=timeout)


def prompt_index(client: int, i: int, clients: int) -> int:
    return (client + clients * i) % len(PROMPTS)


async def _one_request(
    api: openai.AsyncOpenAI, client: int, prompt: int, max_tokens: int
) -> RequestResult:
    result = RequestResult(client, prompt)
    t0 = time.perf_counter()
    try:
        stream = await api.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": PROMPTS[prompt]}],
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},  # a streamed chunk may hold several tokens
        )
        async for chunk in stream:
            content = chunk.choices[0].delta.content if chunk.choices else None
            if content:
                result.text += content
            if result.ttft_s is None and content:
                result.ttft_s = time.perf_counter() - t0
            if chunk.usage is not None:
                result.tokens = chunk.usage.completion_tokens
        if result.tokens == 0:
            result.error = "no usage chunk or no tokens"
    except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the run
        result.error = f"{type(e).__name__}: {e}"
        result.tokens = 0
    result.latency_s = time.perf_counter() - t0
    return result


async def _client(
    url: str, client: int, work: Workload, deadline: float, out: list[RequestResult]
) -> None:
    api = _api(url, work.timeout_s)
    try:
        for i in range(work.requests_per_client):
            if time.monotonic() >= deadline:
                break
            prompt = prompt_index(client, i, work.clients)
            out.append(await _one_request(api, client, prompt, work.max_tokens))
    finally:
        await api.close()


Beside = Callable[[float], Awaitable[Any]]


async def _run(
    url: str, work: Workload, out: list[RequestResult], beside: Sequence[Beside]
) -> tuple[RunResult, list[Any]]:
    duration = work.duration_s if work.duration_s is not None else float("inf")
    t0 = time.perf_counter()
    deadline = time.monotonic() + duration
    others = [asyncio.ensure_future(b(deadline)) for b in beside]
    await asyncio.gather(*(_client(url, c, work, deadline, out) for c in range(work.clients)))
    return RunResult(out, time.perf_counter() - t0), list(await asyncio.gather(*others))


def run_workload(
    url: str,
    work: Workload,
    out: list[RequestResult] | None = None,
    beside: Sequence[Beside] = (),
) -> tuple[RunResult, list[Any]]:
    """Run the clients against `url` until each sent its requests or the duration is over;
    `beside` (each called with the deadline, time.monotonic) run alongside, and what they
    return comes back with the run.

    `out` receives each finished request as it finishes (a sampler may read its length).
    """
    return asyncio.run(_run(url, work, [] if out is None else out, beside))


def warm_up(url: str, max_tokens: int = 8) -> None:
    """One short request that is not measured: first-call costs land here, not in a row.

    Its prompt is not among PROMPTS, so the suffix speculator learns nothing useful from it.
    """

    async def once() -> None:
        api = _api(url, 600.0)
        try:
            await api.chat.completions.create(
                model=MODEL_ID,
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=max_tokens,
                temperature=0.0,
            )
        finally:
            await api.close()

    asyncio.run(once())
