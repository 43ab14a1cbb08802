"""An MTP head's last-rows step (MtpHead.forward_last): the rows before each sequence's last
only store their K/V, and the last rows and the cache are what the whole layer gives."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from specserve.cache.kv import KVCache
from specserve.loading.model import load_model
from specserve.models.qwen3_next import MtpHead
from tests.head_steps import run_steps
from tests.tiny_hybrid import write_hybrid_folder


def _steps(head: MtpHead, last_only: bool) -> tuple[list[torch.Tensor], KVCache]:
    """Each step's output at each sequence's last row (tests/head_steps.py), from
    `forward_last` or from `forward` over every row."""
    cache = head.new_cache(2, 32)
    step = head.forward_last if last_only else head
    runs = run_steps(step, cache, head.cfg.hidden_size, torch.float64)
    rows = [slice(None) if last_only else b.last_rows() for _, b in runs]
    return [cast(torch.Tensor, o)[r] for (o, _), r in zip(runs, rows, strict=True)], cache


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_an_mtp_catch_up_gives_the_whole_layers_last_rows_and_cache(
    arch: str, tmp_path: Path
) -> None:
    write_hybrid_folder(arch, tmp_path, seed=2)
    head = load_model(tmp_path, dtype="float64").model.mtp
    assert head is not None
    rows: list[int] = []  # rows through the layer's MLP (or MoE), per step
    head.layers[0].ffn.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    got, got_cache = _steps(head, last_only=True)
    want, want_cache = _steps(head, last_only=False)
    # the last rows alone, but where one row comes before them: the whole layer
    assert rows == [2, 2, 3] + [10, 4, 3]
    assert [t.shape[0] for t in got] == [2, 2, 2]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert got_cache.lengths == want_cache.lengths == [11, 6]
    for slot, n in enumerate(want_cache.lengths):
        torch.testing.assert_close(got_cache.k[0][slot, :n], want_cache.k[0][slot, :n])
        torch.testing.assert_close(got_cache.v[0][slot, :n], want_cache.v[0][slot, :n])
