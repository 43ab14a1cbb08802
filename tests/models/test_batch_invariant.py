"""Batch-invariant mode: a row's logits are bit-identical alone and inside any batch."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.runner import ModelRunner, SlotInput
from specserve.loading.model import load_model
from specserve.models.layers.invariant import make_batch_invariant
from tests.tiny import VOCAB, write_hf_folder


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    ("dtype", "prepack"), [("float32", True), ("float32", False), ("bfloat16", True)]
)
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_decode_rows_equal_verify_rows_bitwise(
    arch: str, dtype: str, prepack: bool, tmp_path
) -> None:  # noqa: ANN001
    write_hf_folder(arch, tmp_path, seed=4)
    model = load_model(tmp_path, dtype=dtype, prepack=prepack).model
    make_batch_invariant(model)
    prompt, cont = _tokens(21, 0), _tokens(9, 1)

    alone = ModelRunner(model, num_slots=1, max_len=64)
    alone.forward([SlotInput(0, prompt, 0)])
    one_by_one = torch.cat([alone.forward([SlotInput(0, [t])])[0] for t in cont])

    mixed = ModelRunner(model, num_slots=3, max_len=64)
    mixed.forward([SlotInput(2, _tokens(30, 2), 0), SlotInput(0, prompt, 0)])
    # verification-style: all continuation rows at once, beside other slots' rows
    work = [SlotInput(1, _tokens(7, 3)), SlotInput(0, cont, len(cont)), SlotInput(2, _tokens(3, 4))]
    together = mixed.forward(work)[1]
    assert torch.equal(one_by_one, together)
