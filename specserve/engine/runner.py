"""ModelRunner: turns per-slot token lists into one flat forward and hands back logits.

It owns the model, its memory and the rollback strategy for recurrent state. A step's work
is a list of SlotInput (prompt chunks and verification rows alike); the runner
concatenates them into one FlatBatch, runs the model once, and returns each slot's logits
for the rows it asked for. Verification rows (`verify=True`) of a hybrid model either keep
per-token snapshots or get a checkpoint first (engine/rollback.py decides); `commit` then
rolls every verified slot back, replaying accepted tokens for all slots that need it in
ONE batched forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specserve.batch import FlatBatch, SlotInput
from specserve.cache.memory import Memory, SlotState
from specserve.engine.hidden_log import HiddenLog
from specserve.engine.rollback import RollbackPolicy
from specserve.errors import SpecserveError
from specserve.models.layers.embedding import rows_dtype_device
from specserve.models.layers.lowbit import writes_into
from specserve.models.layers.taps import Taps
from specserve.models.registry import LanguageModel

__all__ = ["ModelRunner", "SavedSlot", "SlotInput"]

DEFAULT_SNAPSHOT_DEPTH = 17  # n_rs_seq: the default draft max (16) + the verified token


@dataclass
class SavedSlot:
    """A slot's memory and its hidden states not yet taken, detached from the slot."""

    memory: SlotState
    hidden: HiddenLog | None


class ModelRunner:
    def __init__(
        self,
        model: LanguageModel,
        num_slots: int,
        max_len: int,
        rollback: str = "auto",
        snapshot_depth: int = DEFAULT_SNAPSHOT_DEPTH,
        snapshot_budget: int | None = None,
    ) -> None:
        """rollback: snapshots | checkpoint | auto (recurrent models only);
        snapshot_depth: n_rs_seq, the longest verification that can keep snapshots;
        snapshot_budget: most bytes `auto` may spend on snapshot buffers (None = no cap)."""
        if max_len > model.cfg.context_length:
            raise SpecserveError(
                f"context size {max_len} exceeds the model's {model.cfg.context_length}"
            )
        self.model = model
        self.memory = Memory(model.new_cache(num_slots, max_len))
        self.dtype, self.device = rows_dtype_device(model.embed)
        depth = self._snapshot_depth(rollback, snapshot_depth, snapshot_budget)
        self.policy = RollbackPolicy(rollback, depth)
        # slot -> (start, tokens) of its last verification, for checkpoint replay
        self._verified: dict[int, tuple[int, list[int]]] = {}
        # slot -> its final hidden rows not yet taken (see take_hidden)
        self.record_hidden = False
        # the layers whose inputs it keeps (tap_layers), handed to each forward: the runner's,
        # as engines built over one loaded model in turn (a benchmark's) must not share them
        self.taps: tuple[int, ...] = ()
        self._hidden: dict[int, HiddenLog] = {}
        self._empty_hidden: torch.Tensor | None = None  # take_hidden's [0, D] where none came
        self._logits: torch.Tensor | None = None  # the reused logits buffer (reuse_logits)
        if self.memory.recurrent is not None and self.policy.depth:
            self.memory.recurrent.enable_snapshots(self.policy.depth)
            if rollback == "auto":
                self._calibrate()

    def _snapshot_depth(self, rollback: str, depth: int, budget: int | None) -> int:
        rec = self.memory.recurrent
        if rec is None or rollback == "checkpoint":
            return 0
        if rollback == "auto" and budget is not None:
            s = rec.shape
            per_position = (
                s.num_layers
                * rec.num_slots
                * (
                    s.conv_dim * (s.conv_width - 1) * rec.dtype.itemsize
                    + s.num_heads * s.key_dim * s.value_dim * rec.state_dtype.itemsize
                )
            )
            depth = min(depth, budget // per_position)
        return depth if depth >= 2 else 0  # one snapshot is just the final state

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @torch.inference_mode()
    def forward(self, work: list[SlotInput]) -> list[torch.Tensor]:
        """One forward over every slot's new tokens -> per slot logits [n_logits, V]."""
        starts = [self.memory.length(w.slot) for w in work]
        keep = [self._prepare_verify(w, s) for w, s in zip(work, starts, strict=True)]
        lens = [len(w.tokens) for w in work]
        branches = [w.branches for w in work]  # (), or each alternative's draft token
        if any(branches) and self.memory.recurrent is not None:
            raise SpecserveError("a recurrent model cannot verify alternatives")
        batch = FlatBatch.build(
            [w.slot for w in work],
            starts,
            lens,
            self.device,
            keep if any(keep) else (),
            branches if any(branches) else (),
        )
        flat = [t for w in work for t in w.tokens]
        tokens = torch.tensor(flat, dtype=torch.long, device=self.device)
        taps = Taps(self.taps) if self.taps else None
        hidden = self.model(tokens, batch, self.memory.cache, taps=taps)
        if self.record_hidden:
            self._log_hidden(batch, hidden if taps is None else taps.out)
        rows = [
            r
            for w, end in zip(work, batch.cu_seqlens[1:], strict=True)
            for r in range(end - w.n_logits, end)
        ]
        logits = self.model.logits(hidden[rows], out=self._logits_out(len(rows)))
        return list(logits.split([w.n_logits for w in work]))

    def reuse_logits(self, rows: int) -> None:
        """From now on, write every forward's logits into one buffer, reused (the engine's
        steps: a step's logits are dead by the next forward; other callers keep theirs).

        Why: verifying 16-token drafts of 4 slots makes 68 x 151936 float32 logits (41 MB)
        a step. A new tensor each step was either mmapped and page-faulted in every time
        or left in malloc's heap, where each bigger step raised the server's resident memory
        again (figures: docs/perf/memory.md). The buffer holds `rows` rows from the start (grown
        if a step needs more) and is touched now, so it is resident before any load. Only a
        low-bit LM head writes into it (models/layers/lowbit.py linear_into): with any other,
        this does nothing."""
        if not writes_into(self.model.lm_head):
            return
        self._logits = torch.zeros(rows, self.vocab_size, device=self.device)

    def _logits_out(self, rows: int) -> torch.Tensor | None:
        if self._logits is None:
            return None
        if rows > self._logits.shape[0]:
            self._logits = torch.empty(rows, self.vocab_size, device=self.device)
        return self._logits[:rows]

    def _prepare_verify(self, w: SlotInput, start: int) -> bool:
        """Before a verification: remember its tokens, and give a recurrent model a way
        back (snapshots, or a checkpoint now). Returns whether it keeps snapshots."""
        if not w.verify:
            return False
        self._verified[w.slot] = (start, list(w.tokens))
        if self.memory.recurrent is None:
            return False
        if self.policy.snapshots_for(w.slot, len(w.tokens)):
            return True
        self.memory.checkpoint(w.slot)
        return False

    def commit(self, keeps: dict[int, int], moved: dict[int, int] | None = None) -> None:
        """After verification: slot -> how many tokens of its sequence to keep; `moved`:
        slot -> where its last kept token is stored, where that is an alternative's row
        (batch.py `branches`), moved into place with its hidden state.

        Each slot goes back to its nearest restore point; slots whose point lies before
        n_keep (checkpoints) replay the kept tokens, all in one batched forward.
        """
        replay = []
        moved = moved or {}
        for slot, n_keep in keeps.items():
            start, tokens = self._verified.pop(slot, (n_keep, []))
            if self.memory.recurrent is not None and tokens:
                self.policy.observe(slot, len(tokens), n_keep - start)
            base = self.memory.restorable(slot, n_keep)
            if slot in moved and slot in self._hidden:
                self._hidden[slot].move(moved[slot], n_keep - 1)
            self.memory.commit(slot, base, moved.get(slot))
            if base < n_keep:
                if not start <= base or n_keep > start + len(tokens):
                    raise RuntimeError(f"slot {slot}: nothing to replay from {base} to {n_keep}")
                replay.append(SlotInput(slot, tokens[base - start : n_keep - start], 0))
        if replay:
            t0 = time.perf_counter()
            self.forward(replay)
            self.sync()
            n = sum(len(w.tokens) for w in replay)
            self.policy.observe_replay(n, time.perf_counter() - t0)
        for slot, n_keep in keeps.items():
            self._trim_hidden(slot, n_keep)

    def prefill(self, slot: int, tokens: list[int], chunk: int = 512) -> torch.Tensor:
        """Feed a prompt in chunks (bounded activation memory) -> logits of its last token [V]."""
        logits = None
        for i in range(0, len(tokens), chunk):
            (logits,) = self.forward([SlotInput(slot, tokens[i : i + chunk])])
        if logits is None:
            raise SpecserveError("empty prompt")
        return logits[-1]

    def fork(self, src: int, dst: int) -> None:
        """dst continues from everything src holds: its memory (Memory.copy_slot) and the
        hidden states not yet taken (take_hidden), so a speculator fed them sees the same."""
        self.memory.copy_slot(src, dst)
        self._hidden.pop(dst, None)
        if src in self._hidden:
            self._hidden[dst] = self._hidden[src].copy()

    def save(self, slot: int) -> SavedSlot:
        """A copy of what `fork` would copy from the slot, detached from it."""
        log = self._hidden.get(slot)
        return SavedSlot(self.memory.save(slot), None if log is None else log.copy())

    def restore(self, slot: int, saved: SavedSlot) -> None:
        """Put a saved slot back, into any slot (whatever it held before)."""
        self.memory.restore(slot, saved.memory)
        self._hidden.pop(slot, None)
        if saved.hidden is not None:
            self._hidden[slot] = saved.hidden.copy()  # a saved slot may be restored twice

    def free(self, slot: int) -> None:
        """Forget the slot's sequence (memory, pending verification, hidden states)."""
        self.memory.free(slot)
        self.retire(slot)

    def retire(self, slot: int) -> None:
        """The slot's request ended: forget its verification, hidden states and rollback
        history, but leave its memory (the prompt cache decides what of it to keep)."""
        self._verified.pop(slot, None)
        self._hidden.pop(slot, None)
        self.policy.forget(slot)

    # final hidden states, for speculators that draft from them (mtp) -----------------------
    def tap_layers(self, layers: tuple[int, ...]) -> None:
        """From now on `take_hidden` gives, instead of the final hidden states, the inputs
        of these target layers side by side [n, len(layers) * D] (an EAGLE-3 head's)."""
        n = self.model.cfg.num_layers
        if not layers or any(not 0 <= i < n for i in layers):
            raise SpecserveError(f"layers to tap {list(layers)}: the model has layers 0..{n - 1}")
        if self.record_hidden and self.taps != layers:
            raise SpecserveError("the runner already hands its hidden states to another head")
        self.taps = tuple(layers)
        self.record_hidden = True
        self._hidden.clear()

    def take_hidden(self, slot: int) -> tuple[int, torch.Tensor]:
        """(position p, hidden [n, D]): the final normed hidden states of the slot's tokens
        p .. p + n - 1 computed (and kept) since the last call; [0, D] when none."""
        log = self._hidden.pop(slot, None)
        if log is None:
            return self.memory.length(slot), self._no_hidden()
        return log.first, log.joined(self._no_hidden())

    def _no_hidden(self) -> torch.Tensor:
        width = self.model.cfg.hidden_size * max(1, len(self.taps))
        if self._empty_hidden is None or self._empty_hidden.shape[1] != width:
            self._empty_hidden = torch.zeros(0, width, dtype=self.dtype, device=self.device)
        return self._empty_hidden

    def _log_hidden(self, batch: FlatBatch, hidden: torch.Tensor) -> None:
        cu = batch.cu_seqlens
        for i, (slot, start) in enumerate(zip(batch.slots, batch.starts, strict=True)):
            log = self._hidden.get(slot)
            if log is None or start < log.first:  # none, or the slot went back before it
                log = self._hidden[slot] = HiddenLog(start)
            # a copy of its own rows: a view would keep every slot's rows of the step alive
            log.add(start, hidden[cu[i] : cu[i + 1]].clone())

    def _trim_hidden(self, slot: int, n_keep: int) -> None:
        if slot in self._hidden:
            log = self._hidden[slot]
            log.keep(max(0, n_keep - log.first))

    # timing forwards on slot 0 before serving (rollback's `auto`, the draft cost model) -------
    def sync(self) -> None:
        """Wait for the device's queued work: a GPU forward returns before it has run."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, work: list[SlotInput], repeats: int = 3) -> float:
        """Least seconds of `repeats` forwards of work (slot 0 from empty each time)."""
        best = float("inf")
        for _ in range(repeats):
            self.memory.free(0)
            t0 = time.perf_counter()
            self.forward(work)
            self.sync()
            best = min(best, time.perf_counter() - t0)
        return best

    def time_rows(self, rows: int) -> float:
        """Seconds of one forward over `rows` tokens of slot 0 from empty, with every row's
        logits as a verification has them; slot 0 is freed after. Only before serving (the
        draft cost model's first timings: speculative/cost.py `seed`)."""
        tokens = [i % self.vocab_size for i in range(rows)]
        seconds = self._timed([SlotInput(0, tokens, rows)], repeats=1)
        self.free(0)
        return seconds

    def _calibrate(self) -> None:
        """Time, on slot 0 (free at start-up), a 1-token forward, a k-token one with and
        without snapshots, and a checkpoint; fit the costs `auto` compares.

        Snapshots cost at least two state copies per token (the op writes the state after
        each token, then it goes into the snapshot buffer), so the copy time bounds
        snap_per_token from below: a single A/B pair of forwards is noisier than the
        difference it measures."""
        k = min(self.policy.depth, 8)
        toks = [i % self.vocab_size for i in range(k)]
        one = self._timed([SlotInput(0, toks[:1], 0)])
        plain = self._timed([SlotInput(0, toks, 0)])
        strategy, self.policy.strategy = self.policy.strategy, "snapshots"
        snap = self._timed([SlotInput(0, toks, 0, verify=True)])
        self.policy.strategy = strategy
        self._verified.clear()
        t0 = time.perf_counter()
        self.memory.checkpoint(0)
        self.sync()
        c = self.policy.costs
        c.checkpoint = time.perf_counter() - t0
        c.per_token = max(0.0, (plain - one) / (k - 1))
        c.fixed = max(0.0, one - c.per_token)
        c.snap_per_token = max(2 * c.checkpoint, (snap - plain) / k)
        c.measured = True
        self.policy.counts = dict.fromkeys(self.policy.counts, 0)
        self.memory.free(0)
