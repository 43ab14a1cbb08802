"""How many threads a forward runs on, chosen by what this machine measures now.

On this project's 2-core machines two threads make a quiet machine's decode step faster,
but when anything else runs (a second process, the test suite, another server) a two-thread
parallel region waits for whichever thread the OS descheduled, and the step becomes slower
than on one thread. Which is faster changes with the load, so the engine times each forward
on each thread count, by row-count bucket, and runs on the faster one, trying the other
again for a few forwards now and then. A lone one-forward try is a poor sample (after
forwards on one thread the other worker sleeps, and its first parallel regions pay the
wake-up): with such tries a 4-slot server could stay on the slower count for a whole run.
So a try is BURST forwards with the first not counted, and one thread must be MARGIN faster
than all cores to be chosen.

Tries cost, though: a try runs BURST forwards on the slower count, and frequent tries (with
each new row-count bucket timed on one thread first) made a 4-slot engine slower than
--threads 2 on a quiet machine. So a bucket now starts on all cores (what a quiet machine
wants), tries one thread first after FIRST_TRY forwards, and each try that leaves the
choice as it was doubles the gap to the next (RETRY, 2 RETRY, ... up to RETRY_MAX
forwards); a try that changes the choice, or a preferred count whose time moves by a factor
SLOWDOWN from what it was after the last try (outside load arriving or leaving), brings the
next try forward again (figures: docs/perf/threads.md).

On one thread, though, a load that leaves does not change the step's time, and the gap to
the next try may have grown to RETRY_MAX: a run could stay on one core long after the load
had gone. There the kernel's idle counts (engine/idle_cores.py) bring the try forward once
the other cores sit FREE idle. A sensed try that keeps one thread disarms the sensing until
the next try that the schedule or a time change makes, so a misleading reading costs one
try, not one per reading.

Safe for exactness because the kernels on the hot path give the same bits on any thread
count: our low-bit kernels compute each output on one thread; oneDNN's packed float32
linears and the attention were checked bit for bit, 1 vs 2 threads
(tests/engine/test_threads.py; the real 0.5B in tests/real/test_threads_real.py).
"""

from __future__ import annotations

import functools
import queue
import statistics
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# torch's own count for this machine (its cores, or OMP_NUM_THREADS), read at import, before
# any tuner changes it: a tuner built later, while an earlier engine's left torch on one
# thread, took that one thread for all cores and never tried two
CORES = torch.get_num_threads()
WINDOW = 5  # timings kept per (bucket, threads); their median resists one interrupted step
FIRST_TRY = 4  # forwards of a new bucket (on all cores) before one thread is first tried
RETRY = 24  # forwards between tries after a try that changed the choice
RETRY_MAX = 8 * RETRY  # the longest gap, reached after 3 tries in a row that changed nothing
BURST = 3  # forwards per try; the first is not kept (the idle workers wake up cold in it)
MARGIN = 1.1  # fewer threads only when this much faster: noise must not flip the choice
SLOWDOWN = 1.5  # the choice this much slower or faster than after the last try: try soon
FREE = 0.75  # of each other core idle, on one thread: the load has left, try all cores now


@dataclass
class _Bucket:
    """One row-count bucket: the thread count it runs on and its schedule of tries."""

    choice: int  # the thread count forwards run on outside tries
    gap: int = FIRST_TRY  # forwards from the end of the last try to the next
    since: int = 0  # forwards since then
    trying: int = 0  # the thread count of the try under way (0: none)
    left: int = 0  # its forwards still to run
    reference: float = 0.0  # the choice's median time after the last try
    armed: bool = True  # idle cores may bring a try forward (see the module's docstring)
    sensed: bool = False  # the try under way or due was brought forward by idle cores


class ThreadTuner:
    def __init__(
        self, max_threads: int | None = None, idle: Callable[[], float | None] | None = None
    ) -> None:
        """idle: the idle cores since its last call, or None for no reading (IdleCores)."""
        top = max_threads or CORES
        self.options = (1, top) if top > 1 else (1,)
        self._idle = idle
        self._times: dict[tuple[int, int], deque[float]] = {}
        self._buckets: dict[int, _Bucket] = {}
        self.ran: Counter[int] = Counter()  # forwards per thread count, tries included

    @staticmethod
    def bucket(rows: int) -> int:
        return rows.bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def _state(self, b: int) -> _Bucket:
        if b not in self._buckets:  # a new bucket starts on all cores
            self._buckets[b] = _Bucket(choice=self.options[-1])
        return self._buckets[b]

    def pick(self, rows: int) -> int:
        """The thread count for a forward over `rows` rows; sets torch's to it."""
        b = self.bucket(rows)
        state = self._state(b)
        if not state.trying and len(self.options) > 1 and state.since >= state.gap:
            state.trying = next(t for t in self.options if t != state.choice)
            state.left = BURST
            # the other count's old timings were taken under whatever load there was then
            self._times.pop((b, state.trying), None)
        if state.trying:
            threads = state.trying
        else:
            threads = state.choice
            state.since += 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def record(self, rows: int, threads: int, seconds: float) -> None:
        self.ran[threads] += 1
        b = self.bucket(rows)
        state = self._state(b)
        if state.trying == threads:
            state.left -= 1
            if state.left < BURST - 1:  # the try's first forward: workers woken from sleep
                self._keep(b, threads, seconds)
            if state.left == 0:
                self._end_try(b, state)
            return
        self._keep(b, threads, seconds)
        if state.reference and threads == state.choice:
            ratio = statistics.median(self._times[(b, threads)]) / state.reference
            if not 1 / SLOWDOWN <= ratio <= SLOWDOWN:  # the load changed: still the right count?
                state.since = state.gap
        if threads == 1 and self._idle is not None and len(self.options) > 1:
            self._sense(self._idle())

    def _sense(self, idle: float | None) -> None:
        """The other cores sat idle: bring forward the tries of the buckets on one thread."""
        if idle is None or idle < FREE * (self.options[-1] - 1):
            return
        for state in self._buckets.values():
            if state.choice == 1 and state.armed and not state.trying:
                state.since, state.sensed, state.armed = state.gap, True, False

    def _keep(self, b: int, threads: int, seconds: float) -> None:
        self._times.setdefault((b, threads), deque(maxlen=WINDOW)).append(seconds)

    def _end_try(self, b: int, state: _Bucket) -> None:
        """Compare the try's timings with the choice's recent ones; one thread only when
        MARGIN times faster than all cores."""
        median = {t: statistics.median(self._times[(b, t)]) for t in self.options}
        choice = 1 if median[1] * MARGIN < median[self.options[-1]] else self.options[-1]
        # a try that changed nothing makes the next one wait twice as long
        state.gap = RETRY if choice != state.choice else min(max(2 * state.gap, RETRY), RETRY_MAX)
        state.choice, state.trying, state.since = choice, 0, 0
        state.reference = median[choice]
        state.armed, state.sensed = not state.sensed, False

    def best(self, rows: int) -> int:
        """The thread count forwards over `rows` rows now run on outside tries."""
        state = self._buckets.get(self.bucket(rows))
        return state.choice if state is not None else self.options[-1]

    def settle(self, rows: int) -> None:
        """Set torch's thread count to the choice for `rows` rows, for torch work outside
        the timed forward (a draft model's or a head's forwards). Left at whatever the last
        forward ran on, drafting ran on a try's one thread now and then, and a 0.5B draft
        model's step then cost 0.8 of the 1.5B target's instead of 0.45."""
        threads = self.best(rows)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


class ComputeThread:
    """One long-lived thread for all of a server's torch work: loading, then every step.

    Why one: libgomp (torch's OpenMP on Linux) gives each thread that starts a parallel
    region its own team of workers, and once a process holds more OpenMP threads than cores
    it makes idle workers sleep at once instead of spinning (its "throttled" spin count), so
    each of the ~100 parallel regions in a decode step pays a futex wake-up. A model loaded
    on the main thread and stepped on an engine thread leaves two teams: a decode step on 2
    threads was then much slower, and the tuner above chose 1 thread (figures:
    docs/perf/threads.md).
    """

    def __init__(self, name: str = "specserve-engine") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]
        self._jobs = queue.SimpleQueue()
        # daemon: a stuck step must not keep the process from exiting
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn() on the thread after the jobs before it; its result or error in a Future."""
        done: Future[T] = Future()
        self._jobs.put((fn, done))
        return done

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the thread; waits, and raises what fn raised."""
        return self.submit(functools.partial(fn, *args, **kwargs)).result()

    def close(self) -> None:
        """End the thread once the jobs already submitted have run."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn())
                except BaseException as e:  # handed to whoever waits on the future
                    done.set_exception(e)
