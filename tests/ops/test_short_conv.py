"""Short causal depthwise conv: fast vs naive (outputs AND states), state continuation,
and agreement with transformers' qwen3_next conv functions and cache convention."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from specserve.ops.fast.short_conv import causal_conv1d
from specserve.ops.naive.short_conv import causal_conv1d_naive

TOL = 1e-12
OPS = {"naive": causal_conv1d_naive, "fast": causal_conv1d}
LENGTHS = (1, 2, 3, 7, 16, 64, 130)


def make_inputs(
    seq_len: int,
    kernel: int = 4,
    channels: int = 6,
    batch: int = 2,
    with_state: bool = True,
    with_bias: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, dtype=torch.float64).to(dtype)

    return {
        "x": randn(batch, seq_len, channels),
        "weight": randn(channels, kernel),
        "bias": randn(channels) if with_bias else None,
        "initial_state": randn(batch, channels, kernel - 1) if with_state else None,
    }


def assert_close(actual: torch.Tensor | None, expected: torch.Tensor | None, tol: float) -> None:
    assert actual is not None and expected is not None
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "linear"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "given-state"])
@pytest.mark.parametrize("kernel", [2, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("seq_len", LENGTHS, ids=lambda t: f"T{t}")
def test_fast_matches_naive(
    seq_len: int, kernel: int, with_state: bool, with_bias: bool, activation: str | None
) -> None:
    inputs = make_inputs(seq_len, kernel, with_state=with_state, with_bias=with_bias)
    expected = causal_conv1d_naive(**inputs, activation=activation, output_all_states=True)
    plain = causal_conv1d(**inputs, activation=activation)
    assert plain.states is None
    assert_close(plain.y, expected.y, TOL)
    assert_close(plain.final_state, expected.final_state, TOL)
    snapshots = causal_conv1d(**inputs, activation=activation, output_all_states=True)
    assert_close(snapshots.y, expected.y, TOL)
    assert_close(snapshots.final_state, expected.final_state, TOL)
    assert_close(snapshots.states, expected.states, TOL)


@pytest.mark.parametrize("op", OPS, ids=str)
def test_state_is_the_last_inputs(op: str) -> None:
    """The state holds the last W - 1 inputs, oldest first, reaching into the initial
    state when fewer than W - 1 tokens came in."""
    inputs = make_inputs(2, kernel=4)
    out = OPS[op](**inputs, output_all_states=True)
    history = torch.cat((inputs["initial_state"], inputs["x"].transpose(1, 2)), dim=-1)
    assert torch.equal(out.final_state, history[..., -3:])
    assert out.states is not None
    assert torch.equal(out.states[:, 0], history[..., 1:4])


@pytest.mark.parametrize("op", OPS, ids=str)
def test_states_are_prefix_final_states(op: str) -> None:
    inputs = make_inputs(20, with_bias=True, seed=1)
    states = OPS[op](**inputs, output_all_states=True).states
    assert states is not None
    for t in range(20):
        prefix = causal_conv1d_naive(**{**inputs, "x": inputs["x"][:, : t + 1]})
        assert torch.equal(states[:, t], prefix.final_state)


@pytest.mark.parametrize(
    "first,second", [(1, 1), (2, 5), (3, 1), (64, 66), (1, 130)], ids=lambda n: f"{n}"
)
@pytest.mark.parametrize("op", OPS, ids=str)
def test_split_run_continues_exactly(op: str, first: int, second: int) -> None:
    inputs = make_inputs(first + second, with_bias=True, seed=2)
    whole = OPS[op](**inputs)
    head = OPS[op](**{**inputs, "x": inputs["x"][:, :first]})
    tail = OPS[op](**{**inputs, "x": inputs["x"][:, first:], "initial_state": head.final_state})
    assert_close(torch.cat((head.y, tail.y), dim=1), whole.y, TOL)
    assert torch.equal(tail.final_state, whole.final_state)


@pytest.mark.parametrize("seq_len", [0, 1, 5], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("op", OPS, ids=str)
def test_initial_state_is_not_modified(op: str, seq_len: int) -> None:
    inputs = make_inputs(seq_len)
    before = inputs["initial_state"].clone()
    out = OPS[op](**inputs, output_all_states=True)
    assert torch.equal(inputs["initial_state"], before)
    assert out.final_state.data_ptr() != inputs["initial_state"].data_ptr()


def test_bfloat16_follows_transformers_dtypes() -> None:
    """Conv in weight's dtype, y and states in x's dtype."""
    inputs = make_inputs(9, dtype=torch.bfloat16)
    inputs["weight"] = inputs["weight"].float()
    out = causal_conv1d(**inputs, output_all_states=True)
    expected = causal_conv1d_naive(**inputs, output_all_states=True)
    assert out.y.dtype == out.final_state.dtype == torch.bfloat16
    assert_close(out.y, expected.y, 1e-2)
    assert_close(out.states, expected.states, 0.0)


def transformers_conv(name: str) -> Any:
    """transformers' own torch function (unwrapped from its hub-kernel dispatcher)."""
    module = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    conv = getattr(module, name)
    return getattr(conv, "__wrapped__", conv)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("seq_len", [1, 3, 4, 17], ids=lambda t: f"T{t}")
def test_prefill_matches_transformers(seq_len: int, with_bias: bool) -> None:
    """From a zero state: y as causal_conv1d_fn, and the state as the last W inputs the
    transformers cache keeps (left-padded with zeros), minus its unused oldest column."""
    inputs = make_inputs(seq_len, with_state=False, with_bias=with_bias, seed=3)
    x_channels_first = inputs["x"].transpose(1, 2)
    y = transformers_conv("causal_conv1d_fn")(
        x_channels_first, inputs["weight"], inputs["bias"], activation="silu"
    )
    their_state = F.pad(x_channels_first, (4, 0))[..., -4:]
    ours = causal_conv1d(**inputs)
    assert_close(ours.y, y.transpose(1, 2), TOL)
    assert torch.equal(ours.final_state, their_state[..., 1:])


@pytest.mark.parametrize("seq_len", [1, 2, 5], ids=lambda t: f"T{t}")
def test_update_matches_transformers(seq_len: int) -> None:
    """From a given state: y and the new state as causal_conv1d_update, which keeps W
    inputs; ours == theirs[..., 1:], theirs == F.pad(ours, (1, 0)) as far as y can tell."""
    inputs = make_inputs(seq_len, with_bias=True, seed=4)
    their_state = F.pad(inputs["initial_state"], (1, 0))  # [B, C, W]; column 0 never read
    y = transformers_conv("causal_conv1d_update")(
        inputs["x"].transpose(1, 2), their_state, inputs["weight"], inputs["bias"], "silu"
    )
    ours = causal_conv1d(**inputs)
    assert_close(ours.y, y.transpose(1, 2), TOL)
    assert torch.equal(ours.final_state, their_state[..., 1:])


def test_bad_shapes_are_rejected() -> None:
    inputs = make_inputs(3)
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(**{**inputs, "initial_state": inputs["initial_state"][..., 1:]})
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(**{**inputs, "weight": inputs["weight"][:, :1]})
