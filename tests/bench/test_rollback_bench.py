"""`specserve bench rollback`: scripted drafts keep what the acceptance level says, and every
strategy's verification step is timed on the same steps."""

from __future__ import annotations

import torch

from specserve.bench.rollback import measure, scripted_steps
from specserve.engine.runner import ModelRunner
from specserve.loading.model import load_model
from tests.tiny_hybrid import write_hybrid_folder


def test_scripted_steps_inject_an_error_after_the_accepted_drafts() -> None:
    reference = list(range(100, 120))  # the greedy continuation, last token first
    steps = scripted_steps(reference, k=4, accepted=2, n_steps=2, vocab=128)
    # keep [100, 101, 102]; the target then says 103, from which the next step drafts
    assert steps[0].tokens == [100, 101, 102, 104, 104] and steps[0].kept == 3
    assert steps[1].tokens == [103, 104, 105, 107, 107] and steps[1].kept == 3
    whole = scripted_steps(reference, k=4, accepted=4, n_steps=2, vocab=128)
    assert whole[1].tokens == reference[5:10] and whole[1].kept == 5


def test_every_strategy_is_timed_on_the_same_steps(tmp_path) -> None:  # noqa: ANN001
    write_hybrid_folder("qwen3_5", tmp_path, seed=1, mtp=False)
    model = load_model(tmp_path, dtype="float32", with_tokenizer=False).model
    runners = {
        s: ModelRunner(model, 1, 64, rollback=s, snapshot_depth=5)
        for s in ("snapshots", "checkpoint", "auto")
    }
    reference = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    steps = scripted_steps(reference, k=4, accepted=1, n_steps=4, vocab=128)
    ms = measure(runners, reference[:10], steps, warmup=1)
    assert set(ms) == set(runners) and all(t > 0 for t in ms.values())
    assert runners["checkpoint"].policy.counts["replays"] == 4  # every step kept 2 of 5
    assert runners["snapshots"].policy.counts["replays"] == 0
