"""How many threads a forward runs on, chosen by what this machine measures now.

On this project's 2-core machines two threads make a quiet machine's decode step ~1.6x
faster, but when anything else runs (a second process, the test suite, another server) a
two-thread parallel region waits for whichever thread the OS descheduled, and the step
becomes slower than on one thread (0.5B int8: 65 ms quiet on 2 threads, 97 on 1; under a
competing busy loop 260 on 2 spinning threads, 107 on 1). Which is faster changes with the
load, so the engine times each forward on each thread count, by row-count bucket, and runs
on the faster one, trying the other again for a few forwards every RETRY forwards of that
bucket. Tries used to be one forward each, and a server serving 4 slots could stay on one
thread for a whole run (a 77 ms step; 54 ms on two threads in the next run): a lone try is
a poor sample (after forwards on one thread the other worker sleeps, and its first
parallel regions pay the wake-up), and a flip back needed 3 good tries of 5, 72 forwards
apart. So a try is BURST forwards with the first not counted, and one thread must be
MARGIN faster than all cores to be chosen.

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
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

T = TypeVar("T")

WINDOW = 5  # timings kept per (bucket, threads); their median resists one interrupted step
RETRY = 24  # forwards of a bucket between tries of the other thread count
BURST = 3  # forwards per try; the first is not kept (the idle workers wake up cold in it)
MARGIN = 1.1  # fewer threads only when this much faster: noise must not flip the choice


class ThreadTuner:
    def __init__(self, max_threads: int | None = None) -> None:
        top = max_threads or torch.get_num_threads()
        self.options = (1, top) if top > 1 else (1,)
        self._times: dict[tuple[int, int], deque[float]] = {}
        self._count: dict[int, int] = {}
        self._trial: dict[int, list[int]] = {}  # bucket -> [threads, forwards left]

    @staticmethod
    def bucket(rows: int) -> int:
        return rows.bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def pick(self, rows: int) -> int:
        """The thread count for a forward over `rows` rows; sets torch's to it."""
        b = self.bucket(rows)
        n = self._count.get(b, 0)
        self._count[b] = n + 1
        preferred = self.best(rows)
        if b in self._trial:
            threads = self._trial[b][0]
        elif preferred is None:  # time each count twice first
            threads = next(t for t in self.options if len(self._times.get((b, t), ())) < 2)
        elif n % RETRY == RETRY - 1:  # now and then the other, in case the load changed
            threads = next((t for t in self.options if t != preferred), preferred)
            if threads != preferred:
                self._trial[b] = [threads, BURST]
        else:
            threads = preferred
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def record(self, rows: int, threads: int, seconds: float) -> None:
        b = self.bucket(rows)
        trial = self._trial.get(b)
        if trial is not None and trial[0] == threads:
            trial[1] -= 1
            if trial[1] == 0:
                del self._trial[b]
            if trial[1] == BURST - 1:
                return  # the try's first forward: workers woken from sleep, caches cold
        self._times.setdefault((b, threads), deque(maxlen=WINDOW)).append(seconds)

    def best(self, rows: int) -> int | None:
        """The thread count now preferred for `rows` rows (None until both are measured):
        all cores, unless one thread's median is MARGIN times faster."""
        b = self.bucket(rows)
        timed = [t for t in self.options if len(self._times.get((b, t), ())) >= 2]
        if len(timed) < len(self.options):
            return None
        median = {t: statistics.median(self._times[(b, t)]) for t in timed}
        top = self.options[-1]
        return 1 if median[1] * MARGIN < median[top] else top


class ComputeThread:
    """One long-lived thread for all of a server's torch work: loading, then every step.

    Why one: libgomp (torch's OpenMP on Linux) gives each thread that starts a parallel
    region its own team of workers, and once a process holds more OpenMP threads than cores
    it makes idle workers sleep at once instead of spinning (its "throttled" spin count), so
    each of the ~100 parallel regions in a decode step pays a futex wake-up. A model loaded
    on the main thread and stepped on an engine thread leaves two teams: the 0.5B's decode
    step on 2 threads took 76 ms that way against 38 ms loaded and stepped on one thread,
    and the tuner above then chose 1 thread (55 ms).
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
