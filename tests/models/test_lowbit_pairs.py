"""From how many rows the VNNI kernels pair tiles: the same bits either way, and the choice
models/layers/lowbit_pairs.py makes from its timings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.errors import SpecserveError
from specserve.models.layers.lowbit import Q4KLinear, Q5Linear, Q8Linear
from specserve.models.layers.lowbit_pairs import ENV, kernel_pair_rows, threshold, tune_pairs
from specserve.ops.cpu.build import problem
from tests.isa import kernel_isas
from tests.models.lowbit_cases import KINDS, any_kind, twin

pytestmark = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")


@pytest.fixture
def pair_rows():
    """Restores the process's pair_rows after the test."""
    was = kernel_pair_rows()
    try:
        yield
    finally:
        kernel_pair_rows(was)


NO_VNNI = pytest.mark.skipif(len(kernel_isas()) < 2, reason="this CPU has only AVX2: no pairs")


@NO_VNNI
@pytest.mark.parametrize("cls", KINDS)
def test_paired_and_single_walks_give_the_same_bits(cls: type, pair_rows: None) -> None:
    layer, x = any_kind(cls)  # 9 tiles: a pair walk ends on a lone, padded tile
    for m in range(1, 7):
        got = {}
        for start in (1, m, m + 1):  # pairs at this row count, and not
            kernel_pair_rows(start)
            got[start] = layer(x[:m])
        want = twin(x[:m], layer)
        for start, y in got.items():
            assert torch.equal(y, want), (m, start, (y - want).abs().max())


def test_pairs_start_past_the_most_rows_where_one_tile_won() -> None:
    assert threshold([1.0, 1.1, 1.2], [0.9, 1.0, 1.1]) == 1  # pairs faster at every count
    assert threshold([1.0, 1.1, 1.2], [1.1, 1.0, 1.1]) == 2  # one tile faster at one row
    assert threshold([1.0, 1.1, 1.2], [0.9, 1.0, 1.3]) == 4  # at three rows: not paired below 4
    assert threshold([1.0, 1.1, 1.2], [1.1, 1.2, 1.3]) == 4


def test_the_environment_sets_pair_rows(monkeypatch: pytest.MonkeyPatch, pair_rows: None) -> None:
    monkeypatch.setenv(ENV, "3")
    assert tune_pairs(nn.Linear(4, 4)) == 3 == kernel_pair_rows()
    monkeypatch.setenv(ENV, "two")
    with pytest.raises(SpecserveError, match="SPECSERVE_PAIR_ROWS='two'"):
        tune_pairs(nn.Linear(4, 4))


def test_a_small_model_is_not_timed(monkeypatch: pytest.MonkeyPatch, pair_rows: None) -> None:
    # a tiny model's calls are too short to tell the walks apart: the setting stays
    monkeypatch.delenv(ENV, raising=False)
    kernel_pair_rows(3)
    assert tune_pairs(nn.Sequential(any_kind(Q8Linear)[0], any_kind(Q5Linear)[0])) is None
    assert kernel_pair_rows() == 3


@NO_VNNI
def test_timing_sets_what_it_chose(monkeypatch: pytest.MonkeyPatch, pair_rows: None) -> None:
    from specserve.models.layers import lowbit_pairs

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(lowbit_pairs, "LEAST_BYTES", 0)
    monkeypatch.setattr(lowbit_pairs, "_chosen", None)  # as a fresh process
    kernel_pair_rows(7)
    model = nn.Sequential(any_kind(Q8Linear)[0], any_kind(Q4KLinear)[0])
    chosen = tune_pairs(model)
    assert chosen in (1, 2, 3, 4) and kernel_pair_rows() == chosen
    # a second model in the process takes the choice without timing again
    kernel_pair_rows(7)

    def timed(*args: object) -> None:
        raise AssertionError("timed again")

    monkeypatch.setattr(lowbit_pairs, "time_pairs", timed)
    assert tune_pairs(model) == chosen == kernel_pair_rows()


def test_pair_rows_must_be_positive() -> None:
    with pytest.raises(RuntimeError, match="rows must be >= 0"):
        kernel_pair_rows(-1)
