"""Recurrent memory: rollback to snapshots and checkpoints, batched replay, whole-slot
save / restore (as llama.cpp's test-recurrent-state-rollback does), and the auto policy."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from specserve.engine.rollback import RollbackCosts, RollbackPolicy
from specserve.engine.runner import ModelRunner, SlotInput
from specserve.loading.model import load_model
from specserve.models.qwen3_next import HybridTransformer
from tests.tiny import VOCAB
from tests.tiny_hybrid import HYBRID_ARCHS, write_hybrid_folder

TOL = 1e-10  # float64; paths differ only in how tokens are grouped into forwards
CTX = 96


@functools.cache
def _model(arch: str) -> HybridTransformer:
    folder = Path(tempfile.mkdtemp(prefix=f"specserve-{arch}-"))
    write_hybrid_folder(arch, folder, seed=2, mtp=False)
    return load_model(folder, dtype="float64", with_tokenizer=False).model


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _next_logits(runner: ModelRunner, slot: int, token: int) -> torch.Tensor:
    """Feed one token -> the logits it yields [V]."""
    return runner.forward([SlotInput(slot, [token])])[0][-1]


def _plain(arch: str, tokens: list[int]) -> torch.Tensor:
    """Reference: one token at a time from empty -> logits after the last [V]."""
    runner = ModelRunner(_model(arch), 1, CTX, rollback="checkpoint")
    runner.prefill(0, tokens[:-1])
    return _next_logits(runner, 0, tokens[-1])


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_restored_state_gives_identical_logits_in_fresh_and_reused_slots(arch: str) -> None:
    runner = ModelRunner(_model(arch), 3, CTX)
    prompt, other = _tokens(30, 1), _tokens(25, 2)
    runner.prefill(0, prompt)
    for t in _tokens(4, 3):  # some decoding too
        _next_logits(runner, 0, t)
    saved = runner.memory.save(0)
    runner.prefill(2, other)  # slot 2 holds another sequence
    expected = _next_logits(runner, 0, 7)
    for slot in (1, 2):  # fresh, and reused
        runner.memory.restore(slot, saved)
        assert runner.memory.length(slot) == saved.length
        assert torch.equal(_next_logits(runner, slot, 7), expected), f"slot {slot}"


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_commit_to_each_snapshot_equals_plain_decoding(arch: str) -> None:
    """A verification keeps the state after each of its tokens; committing to any of them
    continues exactly as if only the kept tokens had ever been fed."""
    prompt, verify = _tokens(20, 4), _tokens(6, 5)
    runner = ModelRunner(_model(arch), 1, CTX, rollback="snapshots", snapshot_depth=8)
    runner.prefill(0, prompt)
    before = runner.memory.save(0)
    for keep in range(1, len(verify) + 1):
        runner.memory.restore(0, before)
        runner.forward([SlotInput(0, verify, len(verify), verify=True)])
        runner.commit({0: len(prompt) + keep})
        assert runner.policy.counts["replays"] == 0
        got = _next_logits(runner, 0, 9)
        want = _plain(arch, prompt + verify[:keep] + [9])
        assert (got - want).abs().max().item() < TOL, f"kept {keep}"


def test_checkpoint_replays_the_kept_tokens_of_all_slots_in_one_forward() -> None:
    """Three slots verify; two keep only part of their draft: one replay forward for both,
    and every slot then continues as plain decoding would."""
    arch = "qwen3_5"
    runner = ModelRunner(_model(arch), 3, CTX, rollback="checkpoint")
    prompts = [_tokens(15 + 3 * s, 10 + s) for s in range(3)]
    drafts = [_tokens(5, 20 + s) for s in range(3)]
    for s, p in enumerate(prompts):
        runner.prefill(s, p)
    runner.forward([SlotInput(s, d, len(d), verify=True) for s, d in enumerate(drafts)])
    kept = [2, 5, 1]  # partial, whole, partial
    forwards: list[int] = []
    hook = runner.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        runner.commit({s: len(prompts[s]) + kept[s] for s in range(3)})
    finally:
        hook.remove()  # the model is shared with the other tests
    assert len(forwards) == 1 and runner.policy.counts["replays"] == 1
    for s in range(3):
        got = _next_logits(runner, s, 11)
        want = _plain(arch, prompts[s] + drafts[s][: kept[s]] + [11])
        assert (got - want).abs().max().item() < TOL, f"slot {s}"


def test_a_zero_length_draft_beside_drafted_slots_keeps_its_state() -> None:
    """vLLM #52942: a slot verified with no draft (one token) in the same forward as drafted
    slots must keep exactly the state that one token left."""
    arch = "qwen3_5"
    for rollback in ("snapshots", "checkpoint"):
        runner = ModelRunner(_model(arch), 2, CTX, rollback=rollback)
        a, b = _tokens(12, 30), _tokens(17, 31)
        runner.prefill(0, a)
        runner.prefill(1, b)
        draft = _tokens(4, 32)
        runner.forward([SlotInput(0, [3], 1), SlotInput(1, draft, 4, verify=True)])
        runner.commit({0: len(a) + 1, 1: len(b) + 2})
        got = _next_logits(runner, 0, 5)
        assert (got - _plain(arch, [*a, 3, 5])).abs().max().item() < TOL, rollback


def test_commit_to_a_position_without_saved_state_raises() -> None:
    runner = ModelRunner(_model("qwen3_5"), 1, CTX, rollback="checkpoint")
    runner.prefill(0, _tokens(10, 40))
    assert runner.memory.restorable(0, 7) == 0  # only the start: no snapshots, no checkpoint
    with pytest.raises(RuntimeError, match="no restore point"):
        runner.memory.commit(0, 7)


def test_auto_prefers_checkpoints_when_drafts_are_kept_whole_and_snapshots_otherwise() -> None:
    policy = RollbackPolicy("auto", depth=9)
    policy.costs = RollbackCosts(
        fixed=0.05, per_token=0.002, snap_per_token=0.003, checkpoint=1e-4, measured=True
    )
    for _ in range(20):
        policy.observe(0, 9, 9)  # slot 0: every draft accepted whole
        policy.observe(1, 9, 3)  # slot 1: mostly rejected
    assert not policy.snapshots_for(0, 9)
    assert policy.snapshots_for(1, 9)
    assert not policy.snapshots_for(1, 10)  # longer than the snapshot buffers


def test_snapshot_budget_caps_the_snapshot_depth() -> None:
    model = _model("qwen3_5")
    full = ModelRunner(model, 2, CTX, rollback="snapshots", snapshot_depth=9)
    assert full.policy.depth == 9
    assert full.memory.recurrent is not None
    per_position = full.memory.recurrent.nbytes()["snapshots"] // 9
    capped = ModelRunner(
        model, 2, CTX, rollback="auto", snapshot_depth=9, snapshot_budget=4 * per_position
    )
    assert capped.policy.depth == 4
    none = ModelRunner(model, 2, CTX, rollback="auto", snapshot_budget=per_position)
    assert none.policy.depth == 0 and none.memory.nbytes()["recurrent_snapshots"] == 0
