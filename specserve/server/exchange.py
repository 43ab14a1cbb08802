"""`OutputExchange`: what this server generated goes out, what other servers generated
comes in, for the speculators' cross-request tables (the suffix speculator's global tree).

A replica of a cluster learns only from its own outputs; with `--share-outputs` each
replica hands its finished outputs to the others (cluster/replica.py carries them through
the board actor). Both queues are deques, so the engine thread and the carrier thread
never wait on each other; only the engine thread touches the speculator.

    engine thread:   finished(request) -> outbox          inbox -> apply(speculator)
    carrier thread:  outbox -> take() -> other replicas   give(outputs) -> inbox
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from specserve.engine.request import Request
from specserve.speculative.base import Speculator

# (tenant, output tokens): a tenant's outputs only ever reach the same tenant's tables
Output = tuple[str | None, list[int]]
MAX_QUEUED = 1024  # outputs waiting either way; the oldest go when the other side lags


class OutputExchange:
    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self.outbox: deque[Output] = deque(maxlen=max_queued)
        self.inbox: deque[Output] = deque(maxlen=max_queued)
        self.sent = 0  # outputs taken out (carrier thread)
        self.learned = 0  # outputs from elsewhere a speculator took in (engine thread)

    # engine thread
    def finished(self, request: Request) -> None:
        """A request ended: a whole answer (not aborted or failed) is worth sharing."""
        if request.finish_reason in ("stop", "length") and request.output:
            self.outbox.append((request.cache_salt, list(request.output)))

    def apply(self, speculator: Speculator | None) -> None:
        while self.inbox:
            tenant, output = self.inbox.popleft()
            if speculator is not None and speculator.learn(output, tenant):
                self.learned += 1

    # carrier thread
    def take(self) -> list[Output]:
        out = []
        while self.outbox:
            out.append(self.outbox.popleft())
        self.sent += len(out)
        return out

    def give(self, outputs: Sequence[Output]) -> None:
        self.inbox.extend(outputs)
