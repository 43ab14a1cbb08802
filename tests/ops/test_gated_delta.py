"""Gated delta rule: fast forms vs the naive reference (outputs AND states), and the
naive reference vs transformers' own torch implementations."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from specserve.ops.fast.gated_delta import (
    auto_max_recurrent,
    chunk_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)
from specserve.ops.naive.gated_delta import gated_delta_rule_naive

TOL = 1e-10  # float64: fast forms reorder sums, nothing else

FORMS = {
    "recurrent": recurrent_gated_delta_rule,
    "chunk": chunk_gated_delta_rule,
    "auto": gated_delta_rule,
}
LENGTHS = (1, 2, 7, 16, 64, 100, 130)


@dataclass(frozen=True)
class Shape:
    batch: int
    qk_heads: int
    v_heads: int
    k_dim: int
    v_dim: int

    def __str__(self) -> str:
        return f"B{self.batch}-H{self.qk_heads}x{self.v_heads}-K{self.k_dim}-V{self.v_dim}"


SHAPES = (Shape(2, 2, 2, 8, 8), Shape(1, 2, 4, 16, 8), Shape(2, 1, 1, 4, 12))


def make_inputs(
    shape: Shape,
    seq_len: int,
    with_state: bool,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Any]:
    """Inputs like a Qwen3-Next GDN layer makes them: beta = sigmoid(b) and
    g = -A * softplus(a) with A up to 16, so some heads forget almost everything at once
    (exp of a chunk's summed g underflows: the chunked form must stay finite)."""
    gen = torch.Generator().manual_seed(seed)
    b, hk, hv, kd, vd = shape.batch, shape.qk_heads, shape.v_heads, shape.k_dim, shape.v_dim

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, dtype=torch.float64)

    decay_rate = torch.rand(hv, generator=gen, dtype=torch.float64) * 16
    inputs: dict[str, Any] = {
        "q": randn(b, seq_len, hk, kd),
        "k": randn(b, seq_len, hk, kd),
        "v": randn(b, seq_len, hv, vd),
        "g": -decay_rate * F.softplus(randn(b, seq_len, hv) - 2),
        "beta": torch.sigmoid(randn(b, seq_len, hv)),
        "initial_state": randn(b, hv, kd, vd) if with_state else None,
        "use_qk_l2norm": True,
    }
    return {
        key: value.to(dtype) if isinstance(value, torch.Tensor) else value
        for key, value in inputs.items()
    }


def assert_close(actual: torch.Tensor | None, expected: torch.Tensor | None, tol: float) -> None:
    assert actual is not None and expected is not None
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


def split(inputs: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """The tokens [start, stop) of every per-token input."""
    per_token = ("q", "k", "v", "g", "beta")
    return {
        key: value[:, start:stop] if key in per_token else value for key, value in inputs.items()
    }


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "given-state"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("seq_len", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("form", FORMS, ids=str)
def test_fast_matches_naive(form: str, seq_len: int, shape: Shape, with_state: bool) -> None:
    inputs = make_inputs(shape, seq_len, with_state)
    expected = gated_delta_rule_naive(**inputs, output_all_states=True)
    plain = FORMS[form](**inputs)
    assert plain.states is None
    assert_close(plain.o, expected.o, TOL)
    assert_close(plain.final_state, expected.final_state, TOL)
    snapshots = FORMS[form](**inputs, output_all_states=True)
    assert_close(snapshots.o, expected.o, TOL)
    assert_close(snapshots.final_state, expected.final_state, TOL)
    assert_close(snapshots.states, expected.states, TOL)


@functools.cache
def prefix_final_states(seq_len: int) -> torch.Tensor:
    """[B, T, HV, K, V]: entry t is the naive rule's final state on the first t + 1 tokens."""
    inputs = make_inputs(SHAPES[1], seq_len, with_state=True, seed=1)
    finals = [gated_delta_rule_naive(**split(inputs, 0, t + 1)).final_state for t in range(seq_len)]
    return torch.stack(finals, dim=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("seq_len", [9, 70], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("form", ["naive", *FORMS], ids=str)
def test_states_are_prefix_final_states(form: str, seq_len: int) -> None:
    """states[:, t] is the state the naive rule reaches on the first t + 1 tokens."""
    inputs = make_inputs(SHAPES[1], seq_len, with_state=True, seed=1)
    run = gated_delta_rule_naive if form == "naive" else FORMS[form]
    assert_close(run(**inputs, output_all_states=True).states, prefix_final_states(seq_len), TOL)


@pytest.mark.parametrize(
    "first,second", [(1, 1), (7, 9), (64, 1), (100, 30), (3, 130)], ids=lambda n: f"{n}"
)
@pytest.mark.parametrize("form", ["naive", *FORMS], ids=str)
def test_split_run_continues_exactly(form: str, first: int, second: int) -> None:
    """Running T1 tokens, then T2 from the returned state == running T1 + T2 at once."""
    run = gated_delta_rule_naive if form == "naive" else FORMS[form]
    inputs = make_inputs(SHAPES[0], first + second, with_state=True, seed=2)
    whole = run(**inputs)
    head = run(**split(inputs, 0, first))
    tail = run(**{**split(inputs, first, first + second), "initial_state": head.final_state})
    assert_close(torch.cat((head.o, tail.o), dim=1), whole.o, TOL)
    assert_close(tail.final_state, whole.final_state, TOL)


@pytest.mark.parametrize("form", FORMS, ids=str)
def test_right_padding_leaves_state_unchanged(form: str) -> None:
    """Tokens with g = 0 and beta = 0 (and k = 0) are no-ops: ragged batches can be padded."""
    inputs = make_inputs(SHAPES[0], 20, with_state=True, seed=3)
    padded = make_inputs(SHAPES[0], 25, with_state=True, seed=3)
    for key in ("q", "k", "v", "g", "beta"):
        padded[key] = F.pad(inputs[key], (0, 0) * (inputs[key].dim() - 2) + (0, 5))
    padded["initial_state"] = inputs["initial_state"]
    expected = FORMS[form](**inputs)
    out = FORMS[form](**padded, output_all_states=True)
    assert_close(out.o[:, :20], expected.o, TOL)
    assert_close(out.final_state, expected.final_state, TOL)
    assert out.states is not None
    assert_close(out.states[:, 19], expected.final_state, TOL)


@pytest.mark.parametrize("form", ["naive", *FORMS], ids=str)
def test_initial_state_is_not_modified(form: str) -> None:
    """Checkpoint rollback restores the state it passed in: the ops must not write to it."""
    run = gated_delta_rule_naive if form == "naive" else FORMS[form]
    for seq_len in (0, 1, 5, 70):
        inputs = make_inputs(SHAPES[0], seq_len, with_state=True, seed=4)
        before = inputs["initial_state"].clone()
        out = run(**inputs, output_all_states=True)
        assert torch.equal(inputs["initial_state"], before)
        assert out.final_state is not None
        # Not an alias either (even for T = 0), or updating one would change the other.
        assert out.final_state.data_ptr() != inputs["initial_state"].data_ptr()


@pytest.mark.parametrize("form", FORMS, ids=str)
def test_bfloat16_inputs_keep_a_float32_state(form: str) -> None:
    inputs = make_inputs(SHAPES[1], 12, with_state=True, seed=5, dtype=torch.bfloat16)
    inputs["initial_state"] = inputs["initial_state"].float()
    inputs["g"] = inputs["g"].float()  # the model computes g in float32
    out = FORMS[form](**inputs, output_all_states=True)
    expected = gated_delta_rule_naive(**inputs, output_all_states=True)
    assert out.o.dtype == torch.bfloat16
    assert out.final_state is not None and out.states is not None
    assert out.final_state.dtype == out.states.dtype == torch.float32
    assert_close(out.o, expected.o, 2e-2)
    assert_close(out.final_state, expected.final_state, 1e-4)
    assert_close(out.states, expected.states, 1e-4)


def test_output_final_state_false_returns_none() -> None:
    inputs = make_inputs(SHAPES[0], 3, with_state=False)
    for run in (gated_delta_rule_naive, *FORMS.values()):
        assert run(**inputs, output_final_state=False).final_state is None


@pytest.mark.parametrize("with_states", [False, True], ids=["plain", "states"])
@pytest.mark.parametrize("seq_len", [1, 4, 5, 16, 17], ids=lambda t: f"T{t}")
def test_auto_mode_picks_the_form_by_length(seq_len: int, with_states: bool) -> None:
    inputs = make_inputs(SHAPES[0], seq_len, with_state=True)
    stepped = seq_len <= auto_max_recurrent(with_states)
    form = recurrent_gated_delta_rule if stepped else chunk_gated_delta_rule
    expected = form(**inputs, output_all_states=with_states)
    out = gated_delta_rule(**inputs, output_all_states=with_states)
    assert torch.equal(out.o, expected.o)


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="mode"):
        gated_delta_rule(**make_inputs(SHAPES[0], 3, False), mode="fused")  # type: ignore[arg-type]


def transformers_rule(name: str) -> Any:
    """transformers' own torch function (unwrapped from its hub-kernel dispatcher)."""
    module = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    rule = getattr(module, name)
    return getattr(rule, "__wrapped__", rule)


@functools.cache
def transformers_result(
    theirs: str, seq_len: int, shape: Shape, with_state: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (o, final_state) on float32 inputs (it always computes in float32)."""
    inputs = make_inputs(shape, seq_len, with_state, seed=6, dtype=torch.float32)
    use_l2norm = inputs.pop("use_qk_l2norm")
    q, k, v = inputs.pop("q"), inputs.pop("k"), inputs.pop("v")
    rule = transformers_rule(theirs)
    return rule(q, k, v, output_final_state=True, use_qk_l2norm_in_kernel=use_l2norm, **inputs)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "given-state"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
@pytest.mark.parametrize("seq_len", [1, 5, 64, 100], ids=lambda t: f"T{t}")
@pytest.mark.parametrize(
    "theirs", ["torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"]
)
@pytest.mark.parametrize("ours", ["naive-fp64", "naive", "recurrent", "chunk"])
def test_matches_transformers(
    ours: str, theirs: str, seq_len: int, shape: Shape, with_state: bool
) -> None:
    """Same math as transformers' qwen3_next functions: our float32 forms and our float64
    reference all agree with theirs to float32 rounding."""
    o, final_state = transformers_result(theirs, seq_len, shape, with_state)
    dtype = torch.float64 if ours == "naive-fp64" else torch.float32
    inputs = make_inputs(shape, seq_len, with_state, seed=6, dtype=dtype)
    run = FORMS.get(ours, gated_delta_rule_naive)
    out = run(**inputs)
    assert_close(out.o.float(), o, 1e-5)
    assert out.final_state is not None
    assert_close(out.final_state.float(), final_state, 1e-5)
