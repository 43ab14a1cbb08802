"""Recurrent state of Gated DeltaNet layers: conv + SSM state per slot, and rollback points.

A recurrent layer's state after token t summarises the whole prefix; unlike attention KV it
cannot be truncated. Rolling a slot back to n tokens needs the state after exactly n
tokens, from one of its *restore points*:

- the start (n = 0): zeros;
- snapshots: a forward that keeps per-token states (FlatBatch.keep_states) writes the state
  after each of its T tokens into the slot's snapshot buffer, [slots, depth, ...] with
  depth = n_rs_seq = draft max + 1. Positions start+1 .. start+T become restorable.
- a checkpoint: a copy of the state at the slot's current length, taken on request
  (before a verification, or by a draft model at its catch-up point).

A restore point at position p stays valid while the sequence keeps its first p tokens: a
commit below p drops it, later forwards do not (they only extend the prefix).

Layouts, per Gated DeltaNet layer l (the l-th linear layer of the model):
    conv[l]:      [slots, C, W - 1]         last W - 1 conv inputs (model dtype)
    ssm[l]:       [slots, HV, K, V]         delta-rule state (float32, or float64)
    snap_conv[l]: [slots, depth, C, W - 1]  snap_ssm[l]: [slots, depth, HV, K, V]
    ckpt_conv[l]: [slots, C, W - 1]         ckpt_ssm[l]: [slots, HV, K, V]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.batch import FlatBatch
from specserve.cache.kv import KVCache
from specserve.ops.naive.gated_delta import compute_dtype


@dataclass
class RecurrentShape:
    """Sizes of one Gated DeltaNet layer's state."""

    num_layers: int  # Gated DeltaNet layers
    conv_dim: int  # C
    conv_width: int  # W (the kernel); the state keeps W - 1 inputs
    num_heads: int  # HV
    key_dim: int  # K
    value_dim: int  # V


class RecurrentCache:
    def __init__(
        self,
        shape: RecurrentShape,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        s = shape
        self.shape, self.dtype, self.device = s, dtype, torch.device(device)
        self.state_dtype = compute_dtype(dtype)
        self._conv_tail = (s.conv_dim, s.conv_width - 1)
        self._ssm_tail = (s.num_heads, s.key_dim, s.value_dim)
        self.conv = [self._zeros(num_slots, *self._conv_tail) for _ in range(s.num_layers)]
        self.ssm = [self._zeros(num_slots, *self._ssm_tail, ssm=True) for _ in range(s.num_layers)]
        self.ckpt_conv = [torch.zeros_like(t) for t in self.conv]
        self.ckpt_ssm = [torch.zeros_like(t) for t in self.ssm]
        self.snap_conv: list[torch.Tensor] = []
        self.snap_ssm: list[torch.Tensor] = []
        self.depth = 0
        self.ckpt_pos: list[int | None] = [None] * num_slots
        # snapshots hold the states after positions snap_start+1 .. snap_start+snap_count
        self.snap_start = [0] * num_slots
        self.snap_count = [0] * num_slots

    def _zeros(self, *size: int, ssm: bool = False) -> torch.Tensor:
        dtype = self.state_dtype if ssm else self.dtype
        return torch.zeros(size, dtype=dtype, device=self.device)

    @property
    def num_slots(self) -> int:
        return len(self.ckpt_pos)

    def enable_snapshots(self, depth: int) -> None:
        """Allocate per-token snapshot buffers for verifications of up to `depth` tokens."""
        if depth == self.depth:
            return
        n, layers = self.num_slots, range(self.shape.num_layers)
        self.snap_conv = [self._zeros(n, depth, *self._conv_tail) for _ in layers]
        self.snap_ssm = [self._zeros(n, depth, *self._ssm_tail, ssm=True) for _ in layers]
        self.depth = depth
        self.snap_count = [0] * n

    def nbytes(self) -> dict[str, int]:
        """Bytes of the live states, the snapshot buffers and the checkpoints."""

        def size(ts: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        return {
            "live": size(self.conv + self.ssm),
            "snapshots": size(self.snap_conv + self.snap_ssm),
            "checkpoints": size(self.ckpt_conv + self.ckpt_ssm),
        }

    # used by the Gated DeltaNet layers during a forward ------------------------------------
    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [B] -> copies of their conv [B, C, W-1] and SSM [B, HV, K, V] states."""
        return self.conv[layer][slots], self.ssm[layer][slots]

    def write(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """conv: [B, C, W-1], ssm: [B, HV, K, V]: the slots' states after this forward."""
        self.conv[layer][slots] = conv.to(self.dtype)
        self.ssm[layer][slots] = ssm.to(self.state_dtype)

    def write_snapshots(
        self, layer: int, slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
    ) -> None:
        """conv: [B, T, C, W-1], ssm: [B, T, HV, K, V]: the state after each of T tokens."""
        n = conv.shape[1]
        if n > self.depth:
            raise RuntimeError(f"{n} snapshots do not fit the snapshot depth {self.depth}")
        self.snap_conv[layer][slots, :n] = conv.to(self.dtype)
        self.snap_ssm[layer][slots, :n] = ssm.to(self.state_dtype)

    def after_forward(self, batch: FlatBatch) -> None:
        """Sequences that kept per-token states now have snapshots for all their tokens."""
        for i, slot in enumerate(batch.slots):
            if batch.keeps_states(i):
                self.snap_start[slot] = batch.starts[i]
                self.snap_count[slot] = batch.cu_seqlens[i + 1] - batch.cu_seqlens[i]

    # rollback -------------------------------------------------------------------------------
    def checkpoint(self, slot: int, length: int) -> None:
        """Copy the slot's state (after `length` tokens) aside, to restore it later."""
        for layer in range(self.shape.num_layers):
            self.ckpt_conv[layer][slot] = self.conv[layer][slot]
            self.ckpt_ssm[layer][slot] = self.ssm[layer][slot]
        self.ckpt_pos[slot] = length

    def restore_points(self, slot: int, length: int) -> list[int]:
        """Every n <= length whose state can be restored for the slot, ascending."""
        points = {0, length}
        ckpt = self.ckpt_pos[slot]
        if ckpt is not None:
            points.add(ckpt)
        start = self.snap_start[slot]
        points.update(range(start + 1, start + self.snap_count[slot] + 1))
        return sorted(p for p in points if p <= length)

    def rollback(self, slot: int, n: int, length: int) -> None:
        """Make the slot's state the one after its first n tokens (of `length` now held)."""
        if n != length:
            first = self.snap_start[slot] + 1
            if first <= n < first + self.snap_count[slot]:
                self._load_snapshot(slot, n - first)
            elif n == self.ckpt_pos[slot]:
                self._load_checkpoint(slot)
            elif n == 0:
                self.reset(slot)
                return
            else:
                raise RuntimeError(
                    f"slot {slot}: no restore point at {n} tokens "
                    f"(have {self.restore_points(slot, length)})"
                )
        # restore points past n belong to tokens that are gone
        self.snap_count[slot] = max(0, min(self.snap_count[slot], n - self.snap_start[slot]))
        if (self.ckpt_pos[slot] or 0) > n:
            self.ckpt_pos[slot] = None

    def _load_snapshot(self, slot: int, index: int) -> None:
        for layer in range(self.shape.num_layers):
            self.conv[layer][slot] = self.snap_conv[layer][slot, index]
            self.ssm[layer][slot] = self.snap_ssm[layer][slot, index]

    def _load_checkpoint(self, slot: int) -> None:
        for layer in range(self.shape.num_layers):
            self.conv[layer][slot] = self.ckpt_conv[layer][slot]
            self.ssm[layer][slot] = self.ckpt_ssm[layer][slot]

    def reset(self, slot: int) -> None:
        """Zero state (no tokens), and no restore points."""
        for layer in range(self.shape.num_layers):
            self.conv[layer][slot].zero_()
            self.ssm[layer][slot].zero_()
        self.ckpt_pos[slot] = None
        self.snap_count[slot] = 0

    # whole-slot copy, save / restore -----------------------------------------------------------
    def copy(self, src: int, dst: int, n: int, length: int) -> None:
        """Make dst's state src's after its first n tokens (of the `length` src holds; n a
        restore point of src), with src's restore points up to n; dst's own are dropped."""
        count, ckpt = self.snap_count[src], self.ckpt_pos[src]
        for layer in range(self.shape.num_layers):
            self.conv[layer][dst] = self.conv[layer][src]
            self.ssm[layer][dst] = self.ssm[layer][src]
            if count:
                self.snap_conv[layer][dst, :count] = self.snap_conv[layer][src, :count]
                self.snap_ssm[layer][dst, :count] = self.snap_ssm[layer][src, :count]
            if ckpt is not None:
                self.ckpt_conv[layer][dst] = self.ckpt_conv[layer][src]
                self.ckpt_ssm[layer][dst] = self.ckpt_ssm[layer][src]
        self.snap_start[dst], self.snap_count[dst] = self.snap_start[src], count
        self.ckpt_pos[dst] = ckpt
        self.rollback(dst, n, length)

    def save(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the slot's conv [C, W-1] and SSM [HV, K, V] state, one per layer."""
        return [t[slot].clone() for t in self.conv], [t[slot].clone() for t in self.ssm]

    def load(self, slot: int, conv: list[torch.Tensor], ssm: list[torch.Tensor]) -> None:
        """Install saved states into the slot (restore points are dropped)."""
        self.reset(slot)
        for layer in range(self.shape.num_layers):
            self.conv[layer][slot] = conv[layer]
            self.ssm[layer][slot] = ssm[layer]


@dataclass
class HybridCache:
    """What a hybrid model's forward takes: attention KV for its full-attention layers and
    recurrent state for its Gated DeltaNet layers, advanced together."""

    kv: KVCache
    recurrent: RecurrentCache

    @property
    def lengths(self) -> list[int]:
        return self.kv.lengths

    def check_room(self, batch: FlatBatch) -> None:
        self.kv.check_room(batch)

    def advance(self, batch: FlatBatch) -> None:
        self.kv.advance(batch)
        self.recurrent.after_forward(batch)
