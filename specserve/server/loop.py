"""Engine thread <-> asyncio: one thread owns the engine; handlers talk to it through queues.

    handler (event loop)                         engine thread
    loop.submit(request) -> Handle  --inbox-->   engine.add_request(request)
    (loop.submit_samples: n handles of one prompt, engine.add_samples, one inbox item)
                                                 engine.step(), engine.step(), ...
    async for ev in handle.events() <-----------  Event(tokens, finished, ...)
                            (loop.call_soon_threadsafe onto the handle's asyncio queue)
    handle.cancel()                 --inbox-->   engine.abort(request), between steps

Only the engine thread touches the engine. The HTTP side reads counters and slot states
from a `EngineStatus` the thread publishes after every step (one attribute assignment, so a
reader never sees half an update).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent import futures
from concurrent.futures import Future
from typing import Literal

from specserve.engine.engine import Engine, StepOutput
from specserve.engine.request import Request
from specserve.engine.threads import ComputeThread
from specserve.errors import SpecserveError
from specserve.server.events import EngineFailure, EngineStatus, Event, QueueFull, slot_states
from specserve.server.exchange import OutputExchange
from specserve.server.health import DEFAULT_STALL_TIMEOUT, Health, warm_up
from specserve.server.metrics import Latency
from specserve.trim import BUSY_TRIM_S, release_freed_memory

log = logging.getLogger("specserve.server")

_Kind = Literal["add", "cancel", "stop", "abort_all"]


class Handle:
    """The asyncio side of one request: its events arrive on an asyncio queue."""

    def __init__(self, request: Request, owner: EngineLoop, aloop: asyncio.AbstractEventLoop):
        self.request = request
        self.finished = False  # set on the event loop once the last event is queued
        self._owner = owner
        self._aloop = aloop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = False
        self.t_last: float | None = None  # engine thread: its last delivery (Latency)
        self.siblings: list[Handle] = []  # the other samples of its prompt, added with it

    def post(self, event: Event) -> None:
        """Engine thread: hand an event to the event loop."""
        post_all([(self, event)])

    async def admitted(self) -> None:
        """Wait until the engine has taken the request; raise what it refused it with."""
        event = await self._queue.get()
        if event.error is not None:
            raise event.error

    async def events(self) -> AsyncIterator[Event]:
        """Token events up to and including the finishing one; raises on engine failure."""
        while True:
            event = await self._queue.get()
            if event.error is not None:
                raise event.error
            yield event
            if event.finished:
                return

    def cancel(self) -> None:
        """Abort the request (client gone, stop string seen); its slot frees next step."""
        if not self.finished and not self._cancelled:
            self._cancelled = True
            self._owner._inbox.put(("cancel", self))


def post_all(events: list[tuple[Handle, Event]]) -> None:
    """Engine thread: hand events to their handles' event loops, one call per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Handle, Event]]] = {}
    for handle, event in events:
        by_loop.setdefault(handle._aloop, []).append((handle, event))
    for aloop, batch in by_loop.items():
        # RuntimeError: the event loop is closed, so nobody is listening any more
        with contextlib.suppress(RuntimeError):
            aloop.call_soon_threadsafe(_settle_all, batch)


def _settle_all(events: list[tuple[Handle, Event]]) -> None:
    for handle, event in events:
        handle._owner._settle(handle, event)


class EngineLoop:
    """Runs `engine.step()` in one background thread while any request is live.

    The thread is `compute`, the one that loaded the model when the server built it (see
    ComputeThread for why); the loop closes it when it stops. It warms the engine up before
    its first step, and keeps `health` (server/health.py) for /health.
    """

    def __init__(
        self,
        engine: Engine,
        max_queue: int,
        compute: ComputeThread | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        if max_queue < 0:
            raise SpecserveError(f"--max-queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.num_slots = engine.num_slots
        self.capacity = self.num_slots + max_queue
        self.status = EngineStatus()
        self.health = Health(stall_timeout)
        self.latency = Latency()  # observed by the engine thread, exposed by /metrics
        self._inbox: queue.Queue[tuple[_Kind, Handle | None]] = queue.Queue()
        self.compute = compute or ComputeThread()
        self._done: Future[None] | None = None  # the running loop
        self._in_flight = 0  # event loop thread only
        # engine thread only from here on
        self._live: dict[int, Handle] = {}
        self._stopping = False
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished: Counter[str] = Counter({"stop": 0, "length": 0, "abort": 0, "error": 0})
        self.trims = 0  # times idle memory was handed back (trim.py)
        self.busy_trims = 0  # ... and trims while busy
        self.exchange: OutputExchange | None = None  # set to share outputs (exchange.py)

    # -- event loop side -------------------------------------------------------------------

    def start(self) -> None:
        self._publish()
        self._done = self.compute.submit(self._run)
        self._done.add_done_callback(self._exited)

    @property
    def alive(self) -> bool:
        return self._done is not None and not self._done.done()

    def stop(self, drain_timeout: float = 30.0) -> None:
        """Finish the running requests (at most drain_timeout s), then end the thread."""
        if self._done is not None and not self._done.done():
            self._inbox.put(("stop", None))
            if futures.wait([self._done], drain_timeout).not_done:
                log.warning("requests still running after %.0f s: aborting them", drain_timeout)
                self._inbox.put(("abort_all", None))
                futures.wait([self._done], 10.0)
        self.compute.close()

    def submit(self, request: Request) -> Handle:
        """Queue a request for the engine; call from the event loop. Raises QueueFull."""
        return self.submit_samples([request])[0]

    def submit_samples(self, requests: list[Request]) -> list[Handle]:
        """Queue samples of one prompt (engine.add_samples), each with its own handle; call
        from the event loop. Raises QueueFull; an idle server takes any number of them."""
        if not self.alive:
            raise EngineFailure(self.health.error or "the engine is not running")
        if self._in_flight and self._in_flight + len(requests) > self.capacity:
            raise QueueFull(
                f"all {self.num_slots} slots are busy and {self.capacity - self.num_slots} "
                "requests are waiting; retry later"
            )
        aloop = asyncio.get_running_loop()
        first, *siblings = handles = [Handle(r, self, aloop) for r in requests]
        first.siblings = siblings
        self._in_flight += len(handles)
        self._inbox.put(("add", first))
        if not self.alive:  # it died since the check above, maybe after draining the inbox
            self._drain_inbox()
        return handles

    def _settle(self, handle: Handle, event: Event) -> None:
        if event.finished and not handle.finished:
            handle.finished = True
            self._in_flight -= 1
        handle._queue.put_nowait(event)

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        warm_up(self.engine.runner)  # requests wait in the inbox meanwhile
        self.health.ready = True
        busy = False
        last_trim = time.monotonic()
        try:
            while not (self._stopping and not self.engine.has_work()):
                self._read_inbox(block=not self.engine.has_work())
                if self.exchange is not None:
                    self.exchange.apply(self.engine.speculator)
                self.health.beat(self.engine.has_work())
                if self.engine.has_work():
                    self._step()
                    busy = True
                    if time.monotonic() - last_trim > BUSY_TRIM_S:  # steady load: see trim.py
                        self.busy_trims += release_freed_memory(collect=False)
                        last_trim = time.monotonic()
                elif busy:  # the last request just ended: hand its memory back
                    busy = False
                    self.trims += release_freed_memory()
                    last_trim = time.monotonic()
                self._publish()
        except Exception as e:  # a bug in this loop: fail every request, let /health say so
            log.exception("the engine thread failed")
            self.health.error = f"the engine thread failed: {type(e).__name__}: {e}"
            self._fail_all(e)

    def _exited(self, done: Future[None]) -> None:
        """The engine thread left _run (stopped, or died): fail every request still waiting
        on it, live or in the inbox, so that none waits forever. Runs on that thread (or
        after it), so `_live` is still only touched by one thread at a time."""
        error = None if done.cancelled() else done.exception()
        if error is not None:
            log.error("the engine thread died", exc_info=error)
            self.health.error = f"the engine thread died: {type(error).__name__}: {error}"
        elif self.health.error is None:
            self.health.error = "the engine is not running"
        failure = EngineFailure(self.health.error, 503)
        failed = [(h, Event([], True, error=failure)) for h in self._live.values()]
        self._finished["error"] += len(failed)
        self._live.clear()
        post_all(failed)
        self._drain_inbox()
        with contextlib.suppress(Exception):  # the engine may be half-way through a step
            self._publish()

    def _drain_inbox(self) -> None:
        """Fail every request left in the inbox: no engine thread will read it any more."""
        failure = EngineFailure(self.health.error or "the engine is not running", 503)
        failed = []
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add" and handle is not None:
                failed += [(h, Event([], True, error=failure)) for h in (handle, *handle.siblings)]
        post_all(failed)

    def _read_inbox(self, block: bool) -> None:
        try:
            # idle: sleep until a message; the timeout only guards against a lost wake-up
            item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: _Kind, handle: Handle | None) -> None:
        if kind == "stop":
            self._stopping = True
        elif kind == "abort_all":
            for h in list(self._live.values()):
                self._abort(h)
        elif kind == "add" and handle is not None:
            self._add(handle)
        elif kind == "cancel" and handle is not None and handle.request.id in self._live:
            self._abort(handle)

    def _add(self, handle: Handle) -> None:
        group = [handle, *handle.siblings]
        if self._stopping:
            failure = EngineFailure("the server is shutting down")
            post_all([(h, Event([], True, error=failure)) for h in group])
            return
        try:
            self.engine.add_samples([h.request for h in group])  # one is an ordinary request
        except SpecserveError as e:
            post_all([(h, Event([], True, error=e)) for h in group])
            return
        for h in group:
            self._live[h.request.id] = h
        self._prompt_tokens += len(handle.request.prompt)  # prefilled once for all samples
        post_all([(h, Event([])) for h in group])  # admitted

    def _abort(self, handle: Handle) -> None:
        req = self._live.pop(handle.request.id).request
        self.engine.abort(req)
        self._finished["abort"] += 1
        self.latency.ended(req.timings)
        handle.post(Event([], True, "abort", req.timings.as_dict()))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(e)
            return
        # one wake-up of the event loop per step, not one per request: each costs the
        # event loop thread a turn, taken from the engine's cores
        ready = [d for d in map(self._deliver, outputs) if d is not None]
        if ready:
            post_all(ready)

    def _deliver(self, out: StepOutput) -> tuple[Handle, Event] | None:
        req = out.request
        self._generation_tokens += len(out.tokens)
        if out.finished:
            self._finished[req.finish_reason or "stop"] += 1
            handle = self._live.pop(req.id, None)
            timings = req.timings.as_dict()
            if self.exchange is not None:
                self.exchange.finished(req)
        else:
            handle = self._live.get(req.id)
            timings = None
        if handle is None:
            return None
        if out.error is not None:  # this request alone failed; the engine goes on
            failure = EngineFailure(f"the request failed: {type(out.error).__name__}: {out.error}")
            return handle, Event([], True, error=failure)
        self.latency.delivered(out, handle)
        event = Event(out.tokens, out.finished, req.finish_reason, timings, logprobs=out.logprobs)
        event.drafted, event.drafted_by = out.drafted, out.drafted_by
        return handle, event

    def _fail_all(self, error: Exception) -> None:
        failure = EngineFailure(f"the engine failed: {type(error).__name__}: {error}")
        for handle in list(self._live.values()):
            self._live.pop(handle.request.id)
            self._finished["error"] += 1
            try:
                self.engine.abort(handle.request)
            except Exception:  # the engine is broken already; the request still ends
                log.exception("could not free the slot of request %d", handle.request.id)
            handle.post(Event([], True, error=failure))
        self.engine.prompts.clear()  # what the slots hold may be half-written

    def _publish(self) -> None:
        sched = self.engine.scheduler
        spec = self.engine.speculator
        self.status = EngineStatus(
            slots=slot_states(self.engine),
            running=len(sched.running),
            waiting=len(sched.waiting) + self.engine.samples.waiting,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            finished=dict(self._finished),
            spec=spec.stats.as_dict() if spec is not None else None,
            store=store.stats() if (store := self.engine.prompts.store) is not None else None,
        )
