"""The agent-like sessions the serving benchmarks send (bench/sessions.py, replicas.py).

Every session shares one long system prompt (tool descriptions); its first user message is
the task with its context (6x the words of a later turn), and each later turn adds a short
tool output, re-sending the whole history with the greedy answers in it. Clients either own
their sessions (one turn of each in turn) or share one queue of them (`Shape.order`).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specserve.bench.server_process import MODEL_ID
from specserve.bench.workload import _api

if TYPE_CHECKING:
    import openai

WORDS_PER_TURN = 80  # words of a later turn's tool output (--turn-words); the task: 6x
_WORDS = [
    "def",
    "return",
    "self",
    "value",
    "index",
    "result",
    "buffer",
    "size",
    "for",
    "while",
    "if",
    "else",
    "None",
    "list",
    "dict",
    "import",
    "error",
    "path",
    "config",
    "request",
    "token",
    "cache",
    "slot",
    "the",
    "of",
    "to",
    "and",
    "in",
    "is",
]
SYSTEM = (
    "You are a coding agent. You read tool outputs and answer with the next action. "
    "Tools: read_file(path), write_file(path, text), run(cmd), search(query). "
)


@dataclass
class Turn:
    session: int
    turn: int
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


def system_prompt(words_per_turn: int) -> str:
    """The system prompt every session shares (tool descriptions), ~4x a later turn's."""
    return SYSTEM * max(1, words_per_turn // 5)


def tool_output(session: int, turn: int, words_per_turn: int = WORDS_PER_TURN) -> str:
    """A deterministic, code-like user message for one session's turn."""
    rng = random.Random(session * 1000 + turn)
    lines, words = [], 0
    while words < words_per_turn:
        n = rng.randint(4, 10)
        lines.append("    " * rng.randint(0, 2) + " ".join(rng.choices(_WORDS, k=n)))
        words += n
    head = f"Task {session}: fix the failing code below." if turn == 1 else f"Step {turn} output:"
    return head + "\n" + "\n".join(lines)


async def _session_turn(
    api: openai.AsyncOpenAI, messages: list[Any], max_tokens: int, t: Turn
) -> None:
    t0 = time.perf_counter()
    answer = ""
    try:
        stream = await api.chat.completions.create(
            model=MODEL_ID,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            content = chunk.choices[0].delta.content if chunk.choices else None
            if content:
                answer += content
                if t.ttft_s is None:
                    t.ttft_s = time.perf_counter() - t0
            if chunk.usage is not None:
                t.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                t.cached_tokens = (details.cached_tokens or 0) if details else 0
                t.completion_tokens = chunk.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the run
        t.error = f"{type(e).__name__}: {e}"
    messages.append({"role": "assistant", "content": answer})


async def _turn(
    api: openai.AsyncOpenAI, messages: list[Any], s: int, turn: int, shape: Shape
) -> Turn:
    """Session s's turn: its next user message appended, the answer awaited and kept."""
    words = shape.words * (6 if turn == 1 else 1)
    messages.append({"role": "user", "content": tool_output(s, turn, words)})
    t = Turn(s, turn)
    await _session_turn(api, messages, shape.max_tokens, t)
    return t


async def _client(url: str, sessions: list[int], shape: Shape) -> list[Turn]:
    """One client that owns its sessions: one turn of each in turn."""
    api = _api(url, 1800.0)
    system = system_prompt(shape.words)
    history = {s: [{"role": "system", "content": system}] for s in sessions}
    out = []
    try:
        for turn in range(1, shape.turns + 1):
            for s in sessions:
                out.append(await _turn(api, history[s], s, turn, shape))
    finally:
        await api.close()
    return out


async def _shared_clients(url: str, shape: Shape) -> list[Turn]:
    """Clients that share one queue of sessions: a free client takes the session that has
    waited longest, so a session's turns hop between clients, as users behind a gateway do
    (a client's next request then says nothing about which replica served the session)."""
    system = system_prompt(shape.words)
    history = {s: [{"role": "system", "content": system}] for s in range(shape.sessions)}
    ready: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for s in range(shape.sessions):
        ready.put_nowait((s, 1))
    out: list[Turn] = []

    async def client() -> None:
        api = _api(url, 1800.0)
        try:
            while not ready.empty():
                s, turn = ready.get_nowait()
                out.append(await _turn(api, history[s], s, turn, shape))
                if turn < shape.turns:
                    ready.put_nowait((s, turn + 1))
        finally:
            await api.close()

    await asyncio.gather(*(client() for _ in range(min(shape.clients, shape.sessions))))
    return out


@dataclass(frozen=True)
class Shape:
    """The workload: sessions, turns each, clients at once, answer and message sizes, and
    whether each client owns its sessions ("client") or all share one queue ("shared")."""

    sessions: int
    turns: int
    clients: int
    max_tokens: int
    words: int = WORDS_PER_TURN
    order: str = "client"


def run_sessions(url: str, shape: Shape) -> list[Turn]:
    """Every session's turns, `clients` at a time (by `shape.order`: client c owns sessions
    c, c + clients, ...; or the clients share one queue of sessions)."""

    async def run() -> list[Turn]:
        if shape.order == "shared":
            return await _shared_clients(url, shape)
        n, c = shape.sessions, shape.clients
        groups = [list(range(i, n, c)) for i in range(min(c, n))]
        done = await asyncio.gather(*(_client(url, g, shape) for g in groups))
        return [t for group in done for t in group]

    return asyncio.run(run())
