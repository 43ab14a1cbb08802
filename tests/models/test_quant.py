"""Quantized linear layers compute with the weights they claim, and swap in by module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specserve.batch import FlatBatch
from specserve.cache.kv import KVCache
from specserve.loading.model import linear_modes, load_model
from specserve.models.layers.lowbit import LowbitLinear
from specserve.models.layers.lowbit_fused import FusedPart
from specserve.models.layers.quant import (
    GROUP,
    Int4Linear,
    Int8Linear,
    auto_mode,
    quantize_linear,
)
from specserve.ops.cpu.build import problem
from specserve.ops.naive.lowbit import int4_groups
from tests.spy import Spy
from tests.tiny import VOCAB, make_hf_model
from tests.tiny_gguf import write_gguf

needs_lowbit = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")


def _weight_and_input() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(96, 128, generator=g), torch.randn(5, 128, generator=g)


def test_int8_uses_per_channel_rounded_weights() -> None:
    w, x = _weight_and_input()
    layer = Int8Linear(w, None)
    dequant = layer.q.float() * layer.scale.float()[:, None]
    assert (dequant - w).abs().max() <= (w.abs().amax(1) / 127 / 2 + 1e-2).max()
    want = F.linear(x.bfloat16().float(), dequant)
    assert torch.allclose(layer(x), want, atol=0.05, rtol=0.02)


def test_int4_uses_groupwise_min_max_weights() -> None:
    w, x = _weight_and_input()
    layer = Int4Linear(w, torch.ones(96))
    q, scale, low = int4_groups(w)
    dequant = (q.view(96, -1, GROUP).float() * scale[..., None] + low[..., None]).view(96, 128)
    assert (dequant - w).abs().max() <= scale.max() / 2 + 1e-6
    want = F.linear(x.bfloat16().float(), dequant) + 1
    assert torch.allclose(layer(x), want, atol=0.1, rtol=0.02)


@pytest.mark.parametrize(
    ("gguf_type", "mode"),
    [
        ("Q4_K", "int4"),
        ("Q5_0", "int5"),
        ("Q5_K", "int8"),
        ("Q6_K", "int6"),
        ("Q8_0", "int8"),
        ("F32", None),
    ],
)
def test_auto_maps_gguf_types_to_kernels(gguf_type: str, mode: str | None) -> None:
    assert auto_mode(gguf_type) == mode


@pytest.mark.parametrize(
    ("dtype", "weights"),
    [
        ("bfloat16", "int8"),
        ("bfloat16", "int4"),
        ("bfloat16", "auto"),
        # float32 runs on specserve's own kernels (layers/lowbit.py)
        pytest.param("float32", "int8", marks=needs_lowbit),
        pytest.param("float32", "int5", marks=needs_lowbit),
        pytest.param("float32", "int4", marks=needs_lowbit),
    ],
)
def test_quantized_model_stays_close_to_float(dtype: str, weights: str, tmp_path) -> None:  # noqa: ANN001
    hf = make_hf_model("qwen2", seed=2)
    path = write_gguf(hf, "qwen2", tmp_path / "m.gguf")
    exact = load_model(path, "float32", with_tokenizer=False).model
    quant = load_model(path, dtype, with_tokenizer=False, weights=weights).model
    kind = LowbitLinear if dtype == "float32" else Int4Linear | Int8Linear
    # a fused group (q/k/v, gate/up: one kernel call) counts once per linear it stands for
    n_quant = sum(isinstance(m, kind) for m in quant.modules()) + sum(
        isinstance(m, FusedPart) for m in quant.modules()
    )
    # the tiny GGUF holds float32 tensors, so auto keeps them float
    assert n_quant == (0 if weights == "auto" else 3 * 7 + 1)
    tokens = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(1))
    outs = []
    with torch.no_grad():
        for model in (exact, quant):
            batch = FlatBatch.build([0], [0], [16], tokens.device)
            outs.append(
                model.logits(model(tokens, batch, model.new_cache(1, 32))).float().flatten()
            )
    # random gaussian weights are int4's worst case; real weights fare far better
    assert F.cosine_similarity(outs[0], outs[1], dim=0) > 0.95


def test_unknown_weights_mode_is_a_clear_error() -> None:
    from specserve.errors import SpecserveError

    with pytest.raises(SpecserveError, match="unknown --weights 'int3'"):
        linear_modes(torch.nn.Linear(2, 2), "int3", {})


@needs_lowbit
def test_linears_are_quantized_while_loading_with_a_tied_head(tmp_path) -> None:  # noqa: ANN001
    # the converter quantizes each linear as its tensors arrive; a tied LM head is quantized
    # from the embedding, which stays a float table; the result equals quantizing after
    hf = make_hf_model("qwen2", seed=4, tie_word_embeddings=True)
    path = write_gguf(hf, "qwen2", tmp_path / "m.gguf")
    streamed = load_model(path, "float32", with_tokenizer=False, weights="int8").model
    after = load_model(path, "float32", with_tokenizer=False).model
    assert isinstance(streamed.lm_head, LowbitLinear) and not streamed.embed.weight.is_meta
    n, k = after.embed.weight.shape
    x = torch.randn(3, k)
    ref_head = torch.nn.Linear(k, n, bias=False)
    ref_head.weight.data = after.embed.weight.detach().clone()
    want = quantize_linear(ref_head, "int8", lowbit=True)
    assert torch.equal(streamed.lm_head(x), want(x))
    assert not any(p.is_meta for p in streamed.parameters())
    assert not any(b.is_meta for b in streamed.buffers())


@needs_lowbit
def test_runner_writes_logits_into_its_reused_buffer(tmp_path) -> None:  # noqa: ANN001
    # the engine's steps share one logits buffer (runner.reuse_logits): same logits as a
    # fresh tensor, the buffer grows when a step needs more rows, and a float head opts out
    from specserve.engine.runner import ModelRunner, SlotInput

    path = write_gguf(make_hf_model("qwen2", seed=4), "qwen2", tmp_path / "m.gguf")
    model = load_model(path, "float32", with_tokenizer=False, weights="int8").model

    def work() -> list[SlotInput]:
        return [SlotInput(0, [1, 2, 3, 4], 2), SlotInput(1, [5, 6, 7], 3)]  # 5 logits rows

    plain, reused = ModelRunner(model, 2, 64), ModelRunner(model, 2, 64)
    reused.reuse_logits(3)
    want, got = plain.forward(work()), reused.forward(work())
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    buf = reused._logits
    assert buf is not None and buf.shape[0] == 5 and got[0].data_ptr() == buf.data_ptr()
    (again,) = reused.forward([SlotInput(0, [9])])
    assert again.data_ptr() == buf.data_ptr() and torch.equal(
        again, plain.forward([SlotInput(0, [9])])[0]
    )
    float_runner = ModelRunner(load_model(path, "float32", with_tokenizer=False).model, 1, 64)
    float_runner.reuse_logits(4)
    assert float_runner._logits is None


@needs_lowbit
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen2", {}),
        # q/k norms, sliding windows, GeGLU
        ("gemma3", {"head_dim": 64, "query_pre_attn_scalar": 64}),
    ],
)
def test_one_op_attention_and_mlp_match_the_op_by_op_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, overrides: dict
) -> None:
    # head_dim 64 and fused q/k/v: Attention runs attend_qkv (q/k norms, rotary, cache
    # writes, attention in one op), GatedMLP the gated kernel; the op-by-op path must give
    # the same cache and the same bits (attention) or the same values to float32 rounding
    # (the MLP's exp)
    from specserve.models.layers import basic
    from specserve.models.layers.attention import Attention
    from specserve.models.llama import Block

    monkeypatch.setattr(Block, "use_kernel", False)  # the modules' paths (tested below)
    hf = make_hf_model(arch, seed=5, hidden_size=128, num_attention_heads=2, **overrides)
    path = write_gguf(hf, arch, tmp_path / "m.gguf")
    model = load_model(path, "float32", with_tokenizer=False, weights="int8").model
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert attns and all(a._one_op and isinstance(a.q, FusedPart) for a in attns)
    assert all((a.q_norm is not None) == (arch == "gemma3") for a in attns)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (11,), generator=g)
    step = torch.randint(0, VOCAB, (4,), generator=g)

    def run(one_op: bool) -> tuple[torch.Tensor, KVCache]:
        for a in attns:
            a._one_op = one_op
        cache = model.new_cache(2, 32)
        with torch.no_grad():
            model(prompt, FlatBatch.build([0, 1], [0, 0], [7, 4], "cpu"), cache)
            # then verification-like rows: 3 for slot 1, 1 for slot 0
            out = model(step, FlatBatch.build([1, 0], [4, 7], [3, 1], "cpu"), cache)
        return out, cache

    fused_mlp, _ = run(True)
    monkeypatch.setattr(basic, "joint_output", lambda parts, x: None)  # MLP: op by op
    got, got_cache = run(True)
    want, want_cache = run(False)
    assert torch.equal(got, want)
    for layer in range(len(attns)):
        assert torch.equal(got_cache.k[layer], want_cache.k[layer])
        assert torch.equal(got_cache.v[layer], want_cache.v[layer])
    assert not torch.equal(fused_mlp, want)  # the gated kernel really ran
    assert (fused_mlp - want).abs().max().item() < 1e-4 * want.abs().max().item()


@needs_lowbit
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen2", {}),  # q/k/v bias, SwiGLU
        # q/k norms, sandwich norms, sliding windows, GeGLU
        ("gemma3", {"head_dim": 64, "query_pre_attn_scalar": 64}),
    ],
)
def test_the_kernel_block_gives_the_modules_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, overrides: dict
) -> None:
    # a whole decoder block as one C++ call (ops/cpu/block.cpp) runs the modules' kernels in
    # the modules' order: the same hidden states and the same KV cache, bit for bit
    from specserve.models.llama import Block

    hf = make_hf_model(arch, seed=5, hidden_size=128, num_attention_heads=2, **overrides)
    path = write_gguf(hf, arch, tmp_path / "m.gguf")
    model = load_model(path, "float32", with_tokenizer=False, weights="int8").model
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert blocks and all(b.kernel() is not None for b in blocks)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (11,), generator=g)
    step = torch.randint(0, VOCAB, (4,), generator=g)

    def run(kernel: bool) -> tuple[torch.Tensor, KVCache]:
        monkeypatch.setattr(Block, "use_kernel", kernel)
        cache = model.new_cache(2, 32)
        with torch.no_grad():
            model(prompt, FlatBatch.build([0, 1], [0, 0], [7, 4], "cpu"), cache)
            out = model(step, FlatBatch.build([1, 0], [4, 7], [3, 1], "cpu"), cache)
        return out, cache

    calls = []  # the kernel blocks really run: each forward goes through them

    real = Block.kernel
    monkeypatch.setattr(Block, "kernel", lambda self: Spy(real(self), "forward", calls))
    got, got_cache = run(True)
    assert len(calls) == 2 * len(blocks)
    want, want_cache = run(False)
    assert torch.equal(got, want)
    for layer in range(len(blocks)):
        assert torch.equal(got_cache.k[layer], want_cache.k[layer])
        assert torch.equal(got_cache.v[layer], want_cache.v[layer])


def test_no_kernel_block_off_the_kernels_path(tmp_path: Path) -> None:
    # dequantized float32 weights (no low-bit layers): the blocks keep their modules
    from specserve.models.llama import Block

    hf = make_hf_model("qwen2", seed=5, hidden_size=128, num_attention_heads=2)
    path = write_gguf(hf, "qwen2", tmp_path / "m.gguf")
    model = load_model(path, "float32", with_tokenizer=False).model
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert blocks and all(b.kernel() is None for b in blocks)
