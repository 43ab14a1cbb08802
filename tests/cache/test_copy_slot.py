"""Copying one slot's state into another (Memory.copy_slot, ModelRunner.fork / save /
restore): the copy continues exactly as the original would, from its whole length or from
any restore point, with the original's restore points up to there (float64 tiny models,
dense and hybrid)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from specserve.engine.runner import ModelRunner, SlotInput
from specserve.loading.model import load_model
from specserve.models.registry import LanguageModel
from tests.tiny import VOCAB, write_hf_folder
from tests.tiny_hybrid import write_hybrid_folder

CTX = 96
TOL = 1e-10  # float64; paths differ only in how tokens are grouped into forwards
ARCHS = ["qwen2", "qwen3_5"]


@functools.cache
def _model(arch: str) -> LanguageModel:
    folder = Path(tempfile.mkdtemp(prefix=f"specserve-copy-{arch}-"))
    if arch == "qwen3_5":
        write_hybrid_folder(arch, folder, seed=2, mtp=False)
    else:
        write_hf_folder(arch, folder, seed=2)
    return load_model(folder, dtype="float64", with_tokenizer=False).model


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _next_logits(runner: ModelRunner, slot: int, token: int) -> torch.Tensor:
    return runner.forward([SlotInput(slot, [token])])[0][-1]


def _plain(arch: str, tokens: list[int]) -> torch.Tensor:
    """Reference: the logits after `tokens`, fed from empty in a runner of its own."""
    runner = ModelRunner(_model(arch), 1, CTX, rollback="checkpoint")
    runner.prefill(0, tokens[:-1])
    return _next_logits(runner, 0, tokens[-1])


@pytest.mark.parametrize("arch", ARCHS)
def test_a_copied_slot_continues_as_the_original(arch: str) -> None:
    runner = ModelRunner(_model(arch), 3, CTX)
    prompt = _tokens(30, 1)
    runner.prefill(0, prompt)
    runner.prefill(2, _tokens(40, 2))  # the target slot held a longer, other sequence
    runner.memory.copy_slot(0, 2)
    runner.memory.copy_slot(0, 1)  # and an empty one
    assert [runner.memory.length(s) for s in range(3)] == [30, 30, 30]
    expected = _next_logits(runner, 0, 7)
    for slot in (1, 2):
        assert torch.equal(_next_logits(runner, slot, 7), expected), f"slot {slot}"
    # each goes on alone: a token fed to one does not reach the others
    assert torch.equal(_next_logits(runner, 1, 9), _next_logits(runner, 2, 9))
    assert (_next_logits(runner, 0, 5) - _plain(arch, [*prompt, 7, 5])).abs().max() < TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_a_copy_from_a_restore_point_keeps_the_points_up_to_it(arch: str) -> None:
    """A verification of 6 tokens kept snapshots; a copy of the first 3 of them continues
    as plain decoding of those tokens, and can go back where the original could."""
    runner = ModelRunner(_model(arch), 2, CTX, rollback="snapshots", snapshot_depth=8)
    prompt, verify = _tokens(20, 3), _tokens(6, 4)
    runner.prefill(0, prompt)
    runner.forward([SlotInput(0, verify, len(verify), verify=True)])
    n = len(prompt) + 3
    runner.memory.copy_slot(0, 1, n)
    assert runner.memory.length(1) == n
    mem = runner.memory
    points = [p for p in range(n + 1) if mem.restorable(0, p) == p]
    assert [p for p in range(n + 1) if mem.restorable(1, p) == p] == points
    got = _next_logits(runner, 1, 9)
    assert (got - _plain(arch, prompt + verify[:3] + [9])).abs().max().item() < TOL
    mem.commit(1, n - 1)  # back one token, as the original could
    got = _next_logits(runner, 1, 9)
    assert (got - _plain(arch, prompt + verify[:2] + [9])).abs().max().item() < TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_and_restored_slots_carry_the_hidden_states_not_yet_taken(arch: str) -> None:
    """A speculator fed the target's hidden states (mtp) sees the same ones in a fork."""
    runner = ModelRunner(_model(arch), 3, CTX)
    runner.record_hidden = True
    runner.prefill(0, _tokens(12, 5))
    saved = runner.save(0)
    runner.fork(0, 1)
    runner.restore(2, saved)
    p, rows = runner.take_hidden(0)
    for slot in (1, 2):
        q, copied = runner.take_hidden(slot)
        assert q == p and torch.equal(copied, rows)
    assert torch.equal(_next_logits(runner, 1, 4), _next_logits(runner, 2, 4))


def test_a_copy_needs_a_restore_point_and_another_slot() -> None:
    runner = ModelRunner(_model("qwen3_5"), 2, CTX, rollback="checkpoint")
    runner.prefill(0, _tokens(10, 6))
    with pytest.raises(ValueError, match="no restore point at 7"):
        runner.memory.copy_slot(0, 1, 7)  # a recurrent state exists at 0 and 10 only
    with pytest.raises(ValueError, match="no restore point at 11"):
        runner.memory.copy_slot(0, 1, 11)
    with pytest.raises(ValueError, match="onto itself"):
        runner.memory.copy_slot(0, 0)
    assert runner.memory.length(1) == 0
