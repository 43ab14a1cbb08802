"""`AffinityRouter`: Ray Serve's request-router API over affinity.PrefixRouter.

Ray's `PowerOfTwoChoicesRequestRouter` and `PrefixCacheAffinityRouter` (ray.llm) do most of
this; what this one changes is the key (token ids the ingress computed, not the characters
of the messages) and where the trees live (in the router, the ingress's process, rather
than in one shared actor that every request waits on). The fallback is Ray's own power of
two choices, and Ray's replica queue-length cache and probes supply the loads.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from specserve.cluster.affinity import PrefixRouter

log = logging.getLogger("specserve.cluster")


def prompt_tokens(pending: PendingRequest | None) -> list[int]:
    """The routing key the ingress put on the call (`RouteCall.tokens`); [] if none."""
    if pending is None:
        return []
    for arg in pending.args:
        tokens = getattr(arg, "tokens", None)
        if isinstance(tokens, list):
            return tokens
    return []


class AffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """A follow-up turn goes to the replica holding its prefix unless that one's queue is
    over `threshold` above the least loaded; otherwise power of two choices."""

    def initialize_state(self, threshold: int = 4, min_match: int = 16, **_: Any) -> None:
        self.prefixes: PrefixRouter[ReplicaID] = PrefixRouter(
            threshold=threshold, min_match=min_match
        )

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Ongoing requests per replica: Ray's cache where it has them, else a probe."""
        lens: dict[ReplicaID, int] = {}
        missing = []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                lens[r.replica_id] = n
        for r, n in await self._probe_queue_lens(missing, 0) if missing else []:
            if n is not None:
                lens[r.replica_id] = n
        return lens

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        tokens = prompt_tokens(pending_request)
        if tokens and len(candidate_replicas) > 1:
            lens = await self._queue_lens(candidate_replicas)
            choice = self.prefixes.choose(tokens, lens) if lens else None
            if choice is not None:
                log.debug("%s -> %s (%d tokens)", choice.reason, choice.replica, choice.matched)
                return [[self._replicas[choice.replica]]]
        # Ray's power of two choices, unbound: it takes `self` for its mixins' state
        choose = PowerOfTwoChoicesRequestRouter.choose_replicas
        ranked: list[list[RunningReplica]] = await choose(
            self,  # type: ignore[arg-type]
            candidate_replicas=candidate_replicas,
            pending_request=pending_request,
        )
        return ranked

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        tokens = prompt_tokens(pending_request)
        if tokens:
            self.prefixes.routed(replica_id, tokens)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [r for r in self.prefixes.trees if r not in live]:
            self.prefixes.forget(gone)
