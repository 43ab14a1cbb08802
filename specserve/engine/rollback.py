"""How a hybrid model's verification rolls recurrent state back: per slot and step.

- `snapshots`: the verify forward keeps the state after each of its tokens; commit picks
  one. Costs writing k + 1 states per verify (and n_rs_seq states of memory per slot).
- `checkpoint`: copy the state before verifying; on partial acceptance restore it and
  replay the accepted tokens. Costs a copy per verify and a forward per partial one.
- `auto`: per verification, the one expected to cost less:

      snapshots  : snap_per_token * n
      checkpoint : checkpoint + P(partial) * (fixed + per_token * replay_len)

  The costs are measured on the model itself (`calibrate`, then refined by every replay);
  P(partial) and replay_len are per-slot running averages of what verification did. The
  memory budget caps the snapshot depth; verifications longer than it use checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import SpecserveError

STRATEGIES = ("snapshots", "checkpoint", "auto")
EMA = 0.25  # weight of the newest observation in the running averages


@dataclass
class RollbackCosts:
    """Seconds on this model and device: a forward of n tokens ~ fixed + per_token * n;
    keeping snapshots adds snap_per_token * n to it; a checkpoint copy costs checkpoint."""

    fixed: float = 0.0
    per_token: float = 0.0
    snap_per_token: float = 0.0
    checkpoint: float = 0.0
    measured: bool = False

    def forward(self, n: int) -> float:
        return self.fixed + self.per_token * n


class RollbackPolicy:
    def __init__(self, strategy: str = "auto", depth: int = 0) -> None:
        """depth: the longest verification (tokens) the snapshot buffers hold (0 = none)."""
        if strategy not in STRATEGIES:
            raise SpecserveError(
                f"unknown rollback strategy {strategy!r}; choose from {', '.join(STRATEGIES)}"
            )
        self.strategy, self.depth = strategy, depth
        self.costs = RollbackCosts()
        self._partial: dict[int, float] = {}  # slot -> P(a verification keeps only part)
        self._replay: dict[int, float] = {}  # slot -> tokens replayed when it does
        self.counts = {"snapshots": 0, "checkpoint": 0, "replays": 0}

    def snapshots_for(self, slot: int, n_tokens: int) -> bool:
        """Whether this slot's n-token verification keeps per-token snapshots."""
        fits, auto = n_tokens <= self.depth, self.strategy == "auto"
        use = fits and (self.strategy == "snapshots" or (auto and self._cheaper(slot, n_tokens)))
        self.counts["snapshots" if use else "checkpoint"] += 1
        return use

    def _cheaper(self, slot: int, n: int) -> bool:
        c = self.costs
        if not c.measured:
            return True  # nothing measured yet: snapshots never re-run anything
        p = self._partial.get(slot, 0.5)
        replay = self._replay.get(slot, n / 2)
        return c.snap_per_token * n < c.checkpoint + p * c.forward(round(replay))

    def observe(self, slot: int, n_tokens: int, n_kept: int) -> None:
        """A verification of n_tokens kept n_kept (1 <= n_kept <= n_tokens) of them."""
        partial = n_kept < n_tokens
        self._partial[slot] = _ema(self._partial.get(slot, 0.5), float(partial))
        if partial:
            self._replay[slot] = _ema(self._replay.get(slot, n_kept), n_kept)

    def observe_replay(self, n_tokens: int, seconds: float) -> None:
        """A replay forward of n_tokens (all slots together) took `seconds`."""
        self.counts["replays"] += 1
        c = self.costs
        if c.measured:  # keep the per-token slope, let the offset follow what replays cost
            c.fixed = max(0.0, _ema(c.fixed, seconds - c.per_token * n_tokens))

    def forget(self, slot: int) -> None:
        self._partial.pop(slot, None)
        self._replay.pop(slot, None)


def _ema(old: float, new: float) -> float:
    return (1 - EMA) * old + EMA * new
