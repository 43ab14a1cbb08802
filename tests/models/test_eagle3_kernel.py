"""An EAGLE-3 head's cached step on the kernels' block (DenseBlock.eagle_step) gives the
bits of its modules' path, and a head off the low-bit kernels keeps its modules."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import cast

import pytest
import torch

from specserve.batch import FlatBatch
from specserve.cache.kv import KVCache
from specserve.loading.eagle3 import load_eagle3, save_eagle3
from specserve.loading.model import load_model
from specserve.models.config import ModelConfig
from specserve.models.eagle3 import Eagle3Head
from specserve.ops.cpu.build import problem
from tests.head_steps import STEPS, run_steps
from tests.spy import Spy
from tests.tiny import make_hf_model
from tests.tiny_eagle3 import random_head
from tests.tiny_gguf import write_gguf

needs_lowbit = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")


@pytest.fixture(scope="module")
def target_cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    # hidden 128 over 2 heads: head_dim 64, which the one-op attention (and so the block) takes
    hf = make_hf_model("qwen2", seed=5, hidden_size=128, num_attention_heads=2)
    path = write_gguf(hf, "qwen2", tmp_path_factory.mktemp("target") / "m.gguf")
    return load_model(path, "float32", with_tokenizer=False, weights="int8").cfg


def _head(cfg: ModelConfig, folder: Path, weights: str, before_residual: bool) -> Eagle3Head:
    head = random_head(cfg, heads=2).float()
    head.cfg = replace(head.cfg, norm_before_residual=before_residual)
    save_eagle3(head, folder)
    return load_eagle3(folder, cfg, weights=weights)


def _steps(head: Eagle3Head, last_only: bool = False) -> tuple[list[torch.Tensor], KVCache]:
    """Both outputs of every step (tests/head_steps.py), or with last_only each sequence's
    last row's (`forward_last`)."""
    cache = head.new_cache(2, 32)
    step = head.forward_last if last_only else head
    runs = run_steps(step, cache, head.cfg.hidden_size)
    return [t for out, _ in runs for t in cast(tuple, out)], cache


def _last_rows(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """`_steps`' outputs (two a step) at each step's last row of each sequence."""
    last = [FlatBatch.build([0, 1], s, n, "cpu").last_rows() for s, n in STEPS]
    return [out[last[i // 2]] for i, out in enumerate(outs)]


@needs_lowbit
@pytest.mark.parametrize("before_residual", [False, True])
def test_the_heads_kernel_step_gives_the_modules_bits(
    target_cfg: ModelConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    before_residual: bool,
) -> None:
    head = _head(target_cfg, tmp_path / "head", "int4", before_residual)
    assert head.kernel() is not None
    calls = []  # the kernel block really runs: each step goes through it

    real = Eagle3Head.kernel
    monkeypatch.setattr(Eagle3Head, "kernel", lambda self: Spy(real(self), "eagle_step", calls))
    got, got_cache = _steps(head)
    assert len(calls) == len(STEPS)
    monkeypatch.setattr(Eagle3Head, "use_kernel", False)
    want, want_cache = _steps(head)
    assert len(calls) == len(STEPS)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got_cache.k[0], want_cache.k[0])
    assert torch.equal(got_cache.v[0], want_cache.v[0])


def test_a_float_head_keeps_its_modules(target_cfg: ModelConfig, tmp_path: Path) -> None:
    # dequantized float32 weights (no low-bit layers): no kernel block
    assert _head(target_cfg, tmp_path / "head", "dequant", False).kernel() is None


@pytest.mark.parametrize("weights", ["int4", "dequant"])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_a_catch_up_gives_its_last_rows_bits_and_the_whole_cache(
    target_cfg: ModelConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    weights: str,
    use_kernel: bool,
) -> None:
    # the rows before each sequence's last only store their K/V: the last rows' outputs and
    # the cache are those of the whole layer run over every row, the same bits on the
    # low-bit kernels (a row's result never depends on the others'); float linears go
    # through BLAS, whose sums follow the row count
    head = _head(target_cfg, tmp_path / "head", weights, False)
    monkeypatch.setattr(Eagle3Head, "use_kernel", use_kernel)
    stored: list[int] = []  # rows whose K/V alone were made, per step that split its rows
    split_last = FlatBatch.split_last

    def counted(self):  # noqa: ANN001, ANN202
        before, early, last = split_last(self)
        stored.append(len(early))
        return before, early, last

    monkeypatch.setattr(FlatBatch, "split_last", counted)
    got, got_cache = _steps(head, last_only=True)
    assert stored == [8, 2]  # the last step has one row before its last: the whole layer
    everything, want_cache = _steps(head)
    want = _last_rows(everything)
    same = torch.equal if weights == "int4" else partial(torch.allclose, atol=1e-5)
    assert [t.shape[0] for t in got] == [2] * 6
    for a, b in zip(got, want, strict=True):
        assert same(a, b)
    assert got_cache.lengths == want_cache.lengths == [11, 6]
    for slot, n in enumerate(want_cache.lengths):
        assert same(got_cache.k[0][slot, :n], want_cache.k[0][slot, :n])
        assert same(got_cache.v[0][slot, :n], want_cache.v[0][slot, :n])
