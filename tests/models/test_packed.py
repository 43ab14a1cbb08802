"""oneDNN pre-packed float32 linears: same products as F.linear, rows independent of M."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.engine.runner import ModelRunner, SlotInput
from specserve.loading.model import load_model
from specserve.models.layers.packed import PackedLinear, pack_linears
from tests.tiny import VOCAB, write_hf_folder

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(2, 7, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed(x).shape == (2, 7, 200)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(256, 512))
    x = torch.randn(40, 256)
    with torch.inference_mode():
        alone = torch.cat([packed(x[i : i + 1]) for i in range(len(x))])
        for m in range(1, len(x) + 1):
            assert torch.equal(packed(x[:m]), alone[:m]), f"{m} rows"


def test_only_float32_cpu_linears_are_packed() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).double(), nn.Linear(8, 8).bfloat16())
    assert pack_linears(model) == 1
    assert [type(m) for m in model] == [PackedLinear, nn.Linear, nn.Linear]


def test_packed_model_matches_unpacked(tmp_path) -> None:  # noqa: ANN001
    write_hf_folder("qwen2", tmp_path, seed=5)
    packed = load_model(tmp_path, dtype="float32").model
    plain = load_model(tmp_path, dtype="float32", prepack=False).model
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    tokens = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    outs = []
    for model in (packed, plain):
        runner = ModelRunner(model, num_slots=1, max_len=32)
        outs.append(runner.forward([SlotInput(0, tokens, len(tokens))])[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
