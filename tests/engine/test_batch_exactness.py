"""A sequence's logits do not depend on its batch-mates, nor on a truncate + re-feed (float64)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.runner import ModelRunner, SlotInput
from specserve.loading.model import load_model
from tests.tiny import VOCAB, write_hf_folder


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def model(request, tmp_path_factory):  # noqa: ANN001, ANN201
    folder = tmp_path_factory.mktemp(request.param)
    write_hf_folder(request.param, folder, seed=3)
    return load_model(folder, dtype="float64").model


def _rand(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def test_alone_equals_inside_flat_batch(model) -> None:  # noqa: ANN001
    target = _rand(23, 0)
    alone = ModelRunner(model, num_slots=1, max_len=128)
    (ref,) = alone.forward([SlotInput(0, target, n_logits=len(target))])

    mixed = ModelRunner(model, num_slots=4, max_len=128)
    # warm the other slots with different histories so their caches differ
    others = {1: _rand(5, 1), 2: _rand(17, 2), 3: _rand(40, 3)}
    mixed.forward([SlotInput(s, t) for s, t in others.items()])
    work = [SlotInput(2, _rand(3, 4)), SlotInput(0, target, len(target)), SlotInput(3, [7])]
    work.append(SlotInput(1, _rand(9, 5)))
    got = mixed.forward(work)[1]
    assert (got - ref).abs().max().item() < 1e-12


def test_truncate_and_refeed_gives_same_logits(model) -> None:  # noqa: ANN001
    runner = ModelRunner(model, num_slots=2, max_len=128)
    seq = _rand(30, 6)
    (first,) = runner.forward([SlotInput(0, seq, n_logits=10)])
    for n in (1, 4, 10):
        runner.memory.commit(0, len(seq) - n)
        (again,) = runner.forward([SlotInput(0, seq[-n:], n_logits=n)])
        assert (again - first[-n:]).abs().max().item() < 1e-12
    assert runner.memory.length(0) == len(seq)


def test_context_overflow_is_a_clear_error(model) -> None:  # noqa: ANN001
    from specserve.errors import SpecserveError

    runner = ModelRunner(model, num_slots=1, max_len=16)
    with pytest.raises(SpecserveError, match="context overflow"):
        runner.forward([SlotInput(0, _rand(17, 7))])
