"""EngineLoop and Engine.abort without HTTP: cancellation frees slots, failures reach callers."""

from __future__ import annotations

import asyncio

import pytest

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams, Status
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.errors import SpecserveError
from specserve.loading.model import LoadedModel
from specserve.server.events import EngineFailure, QueueFull
from specserve.server.loop import EngineLoop


def request(prompt: str, loaded: LoadedModel, max_tokens: int = 8) -> Request:
    assert loaded.tokenizer is not None
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(loaded.tokenizer.encode(prompt), params, SpecParams(n_max=0))


def test_abort_frees_a_running_slot_and_drops_a_waiting_request(tiny_model: LoadedModel) -> None:
    engine = Engine(ModelRunner(tiny_model.model, num_slots=1, max_len=64))
    running, waiting = request("hello", tiny_model), request("world", tiny_model)
    engine.add_request(running)
    engine.add_request(waiting)
    engine.step()
    assert running.slot == 0 and engine.runner.memory.length(0) > 0
    engine.abort(waiting)
    engine.abort(running)
    engine.abort(running)  # twice is harmless
    assert not engine.has_work() and engine.scheduler.free_slots == [0]
    # the slot keeps what the aborted request had fed, for the prompt cache
    assert engine.runner.memory.length(0) <= len(running.context)
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert waiting.status is Status.FINISHED
    # the freed slot serves the next request exactly as a fresh engine would
    again, fresh = request("hello", tiny_model), request("hello", tiny_model)
    engine.generate([again])
    Engine(ModelRunner(tiny_model.model, num_slots=1, max_len=64)).generate([fresh])
    assert again.output == fresh.output


def test_loop_streams_refuses_and_reports_failures(tiny_model: LoadedModel) -> None:
    engine = Engine(ModelRunner(tiny_model.model, num_slots=1, max_len=64))
    loop = EngineLoop(engine, max_queue=1)
    loop.start()

    async def scenario() -> None:
        handle = loop.submit(request("hello", tiny_model, max_tokens=5))
        await handle.admitted()
        tokens = [t async for ev in handle.events() for t in ev.tokens]
        assert len(tokens) == 5 and handle.finished
        too_long = loop.submit(request("x" * 80, tiny_model))
        with pytest.raises(SpecserveError, match="the context holds 64"):
            await too_long.admitted()
        first, second = (loop.submit(request(p, tiny_model, 50)) for p in ("a", "b"))
        with pytest.raises(QueueFull):
            loop.submit(request("c", tiny_model))
        first.cancel(), second.cancel()
        for cancelled in (first, second):
            events = [ev async for ev in cancelled.events()]
            assert events[-1].finish_reason == "abort"

        def broken() -> list:
            raise RuntimeError("boom")

        engine.step = broken  # type: ignore[method-assign]
        failing = loop.submit(request("hello", tiny_model))
        await failing.admitted()
        with pytest.raises(EngineFailure, match="RuntimeError: boom"):
            [ev async for ev in failing.events()]

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
        assert loop.alive  # a failed step fails its requests, not the server
    finally:
        loop.stop(drain_timeout=5)
    assert not loop.alive
    assert loop.status.finished == {"stop": 0, "length": 1, "abort": 2, "error": 1}


def test_memory_is_handed_back_each_time_the_engine_goes_idle(tiny_model: LoadedModel) -> None:
    loop = EngineLoop(Engine(ModelRunner(tiny_model.model, num_slots=2, max_len=64)), 0)
    loop.start()

    async def burst() -> None:
        handles = [loop.submit(request(p, tiny_model, max_tokens=4)) for p in ("a", "b")]
        for h in handles:
            [ev async for ev in h.events()]

    try:
        asyncio.run(asyncio.wait_for(burst(), timeout=30))
        deadline = asyncio.run(_wait_for(lambda: loop.trims == 1))
        assert deadline, "no trim after the first burst"
        asyncio.run(asyncio.wait_for(burst(), timeout=30))
        assert asyncio.run(_wait_for(lambda: loop.trims == 2)), "one trim per idle, not per step"
        assert loop.busy_trims == 0  # bursts shorter than BUSY_TRIM_S
    finally:
        loop.stop(drain_timeout=5)


def test_memory_is_handed_back_under_steady_load_too(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specserve.server import loop as loop_module

    monkeypatch.setattr(loop_module, "BUSY_TRIM_S", 0.0)  # every step counts as a long while
    loop = EngineLoop(Engine(ModelRunner(tiny_model.model, num_slots=1, max_len=64)), 0)
    loop.start()

    async def one() -> None:
        [ev async for ev in loop.submit(request("a", tiny_model, max_tokens=4)).events()]

    try:
        asyncio.run(asyncio.wait_for(one(), timeout=30))
        assert loop.busy_trims >= 3  # a trim after each of the request's steps
    finally:
        loop.stop(drain_timeout=5)


async def _wait_for(cond, timeout: float = 5.0) -> bool:  # noqa: ANN001
    for _ in range(int(timeout / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return False


def test_release_freed_memory_runs_glibc_malloc_trim() -> None:
    from specserve.trim import release_freed_memory

    # every machine this project runs on has glibc; elsewhere it is a documented no-op
    assert release_freed_memory() is True
