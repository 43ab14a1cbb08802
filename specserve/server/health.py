"""What GET /health reports, and the engine warm-up that decides when it may say ok.

    503 loading   until the engine thread has run one tiny forward (kernels built and warm)
    503 stalled   the engine has work but has not finished a loop turn in stall_timeout s
    503 error     the engine thread has ended (died, or the server stopped it): the reason
    200 ok        otherwise; the body is exactly {"status": "ok"}

The engine thread writes these fields and the event loop reads them; each is one attribute
assignment, so a reader sees the old value or the new one, never half of each.
"""

from __future__ import annotations

import time
from typing import Any

from specserve.engine.runner import ModelRunner, SlotInput
from specserve.errors import SpecserveError

DEFAULT_STALL_TIMEOUT = 60.0


class Health:
    """The engine's state as /health reports it (see the module docstring)."""

    def __init__(self, stall_timeout: float = DEFAULT_STALL_TIMEOUT) -> None:
        if stall_timeout <= 0:
            raise SpecserveError(f"--stall-timeout must be > 0, got {stall_timeout}")
        self.stall_timeout = stall_timeout
        self.ready = False  # the warm-up forward has run
        self.error: str | None = None  # why the engine thread ended, once it has
        # (monotonic time a loop turn began, whether the engine had work then)
        self._turn: tuple[float, bool] = (time.monotonic(), False)

    def beat(self, busy: bool) -> None:
        """Engine thread, at each loop turn: it is alive, and has work (or not)."""
        self._turn = (time.monotonic(), busy)

    def report(self, alive: bool) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for /health; alive: the engine thread is running `_run`."""
        if self.error is not None or not alive:
            return 503, {"status": "error", "message": self.error or "the engine is not running"}
        if not self.ready:
            return 503, {"status": "loading", "message": "the engine is warming up"}
        began, busy = self._turn
        waited = time.monotonic() - began
        if busy and waited > self.stall_timeout:
            message = f"the engine has work but no step has finished for {waited:.0f} s"
            return 503, {"status": "stalled", "message": message}
        return 200, {"status": "ok"}


def warm_up(runner: ModelRunner) -> None:
    """One 1-token forward on slot 0, then forget it: the first forward builds or loads the
    CPU kernels (ops/cpu/build.py), which must happen before /health says ok rather than
    in the first request. Slot 0 holds nothing afterwards (memory, hidden states)."""
    if runner.memory.length(0) > 0:  # it has run before (warm), and may hold a cached prompt
        return
    runner.forward([SlotInput(0, [0], 1)])
    runner.free(0)
