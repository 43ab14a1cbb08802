"""Real 0.5B: logits are bit-identical on 1 and 2 threads (prefill, decode, verification),
in float32 (oneDNN packed) and int8 (our kernels): the ThreadTuner may switch freely."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.runner import ModelRunner, SlotInput
from specserve.loading.model import load_model


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["dequant", "int8"])
def test_logits_do_not_depend_on_the_thread_count(weights: str, qwen05_path) -> None:  # noqa: ANN001
    model = load_model(qwen05_path, "float32", with_tokenizer=False, weights=weights).model
    before = torch.get_num_threads()
    outs = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runner = ModelRunner(model, num_slots=1, max_len=400)
            steps = [runner.forward([SlotInput(0, list(range(100, 300)))])[0][-1]]
            for t in (5, 6):
                steps.append(runner.forward([SlotInput(0, [t])])[0][-1])
            steps.append(runner.forward([SlotInput(0, list(range(1, 9)), 8)])[0])
            outs[threads] = steps
    finally:
        torch.set_num_threads(before)
    for a, b in zip(outs[1], outs[2], strict=True):
        assert torch.equal(a, b)
