"""A request's n choices: one engine request each (samples of one prompt, prefilled once:
engine/samples.py), their runs merged into one stream or collected into one response.

Seeds: choice i of a request with `seed` s samples with seed s + i, so choice 0 is what the
same request with n = 1 gives, and a choice can be reproduced alone; without a seed each
choice draws its own. Greedy choices (temperature 0) are all the same text.

The choices live and end together: a client that goes away cancels all of them, and so
does a response that ends early. In the engine each one is a request of its own, so one
that fails fails alone there; the response, which has no place for one choice's error,
is then that error (a 500, or the stream's error event).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TypeVar

from fastapi import Request

from specserve.engine.sampling import SamplingParams
from specserve.server.errors import ApiError
from specserve.server.events import EngineFailure
from specserve.server.loop import Handle
from specserve.server.streams import Choices, Delta, Finish

T = TypeVar("T")


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s settings: the request's, with seed s + index (or none: its own)."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


@dataclasses.dataclass
class _End:
    """A run ended (error: what it raised)."""

    error: Exception | None = None


async def merged(runs: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """The items of several runs as they come, each with its run's index; what a run
    raises is raised here. Leaving early stops every run."""
    if len(runs) == 1:
        async for item in runs[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T | _End]] = asyncio.Queue()

    async def pump(index: int, run: AsyncIterator[T]) -> None:
        try:
            async for item in run:
                await queue.put((index, item))
        except Exception as e:
            await queue.put((index, _End(e)))
        else:
            await queue.put((index, _End()))

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        running = len(tasks)
        while running:
            index, got = await queue.get()
            if not isinstance(got, _End):
                yield index, got
            elif got.error is not None:
                raise got.error
            else:
                running -= 1
    finally:
        for task in tasks:
            task.cancel()


async def collect(
    runs: Sequence[AsyncIterator[Delta | Finish]], handles: list[Handle], request: Request
) -> Choices:
    """Each choice's whole text (and logprobs) and finish; every choice is cancelled if the
    client goes away or one of them fails."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, handles))
    parts: list[list[Delta]] = [[] for _ in runs]
    fins: list[Finish | None] = [None] * len(runs)
    try:
        async with contextlib.aclosing(merged(runs)) as items:  # a failure stops them all
            async for index, item in items:
                if isinstance(item, Finish):
                    fins[index] = item
                else:
                    parts[index].append(item)
    except EngineFailure as e:
        raise ApiError(e.status, str(e)) from e
    finally:
        watcher.cancel()
        cancel(handles)  # no-op for those that finished
    done = [(Delta.join(p), f) for p, f in zip(parts, fins, strict=True) if f is not None]
    if len(done) < len(runs):
        raise ApiError(500, "the generation ended without a finish reason")
    return done


def cancel(handles: list[Handle]) -> None:
    for handle in handles:
        handle.cancel()


async def _cancel_on_disconnect(request: Request, handles: list[Handle]) -> None:
    # a non-streaming client that hangs up is noticed only by polling (no send fails)
    while not all(h.finished for h in handles):
        if await request.is_disconnected():
            cancel(handles)
            return
        await asyncio.sleep(0.25)
