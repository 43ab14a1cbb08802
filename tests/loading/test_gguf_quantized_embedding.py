"""A GGUF's block-quantized embedding stays quantized in memory (QuantizedEmbedding) and the
LM head is quantized a range of rows at a time, and the model computes exactly what it
computed when the loader dequantized both tables whole (loading/gguf.py RAW_TABLES = ())."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from specserve.batch import FlatBatch
from specserve.engine.runner import ModelRunner, SlotInput
from specserve.loading import convert
from specserve.loading import gguf as gguf_loading
from specserve.loading.model import load_model
from specserve.models.layers.embedding import QuantizedEmbedding, QuantizedTable
from specserve.models.layers.lowbit import LowbitLinear
from specserve.models.layers.quant import quantize_weight
from specserve.models.registry import LanguageModel
from specserve.ops.cpu.build import problem
from tests.tiny import make_hf_model
from tests.tiny_gguf import gguf_blocks, write_gguf
from tests.tiny_gguf_hybrid import write_hybrid_gguf
from tests.tiny_hybrid import make_hybrid_model, mtp_tensors

needs_lowbit = pytest.mark.skipif(problem() is not None, reason=f"low-bit kernels: {problem()}")

VOCAB = 130  # not a whole number of the kernels' 8-row tiles: the last chunk is padded
CHUNK = 24  # rows per chunk in these tests (the loader's default is 8192)
PROMPT = torch.tensor([5, 77, 3, 3, 120, 64, 1, 99, 42, 127, 0, 18])

# (arch, GGUF tables written as blocks, HF overrides); a table not named stays float32
CASES = {
    "q8-untied": ("qwen2", {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"}, {}),
    "q5-tied": ("qwen2", {"token_embd.weight": "Q5_0"}, {"tie_word_embeddings": True}),
    "k-quants-untied": (
        "qwen2",
        {"token_embd.weight": "Q4_K", "output.weight": "Q6_K"},  # Qwen2.5-1.5B's types
        {"hidden_size": 256},
    ),
    "q4k-tied": (
        "llama",
        {"token_embd.weight": "Q4_K"},
        {"hidden_size": 256, "tie_word_embeddings": True},
    ),
    # gemma: tied, and the embedding scale sqrt(hidden) applies after the lookup
    "gemma-q8": (
        "gemma3",
        {"token_embd.weight": "Q8_0"},
        {"num_hidden_layers": 6, "layer_types": None},
    ),
}


def _write(case: str, tmp_path: Path) -> Path:
    arch, tables, overrides = CASES[case]
    hf = make_hf_model(arch, seed=11, vocab_size=VOCAB, **overrides)
    return write_gguf(hf, arch, tmp_path / f"{case}.gguf", tables)


def _load_both(
    path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, weights: str, prepack: bool = True
) -> tuple[LanguageModel, LanguageModel]:
    """(the model as loaded before QuantizedEmbedding: both tables dequantized whole and
    the head quantized in one piece; the model as loaded now, in chunks of CHUNK rows)."""
    kwargs = dict(with_tokenizer=False, weights=weights, prepack=prepack)
    # Q4_K and Q6_K blocks taken as they are (test_q4k.py, test_q6k.py): another change, off here
    monkeypatch.setattr(gguf_loading, "RAW_TYPES", ())
    monkeypatch.setattr(convert, "NATIVE_TYPES", {})
    with monkeypatch.context() as m:
        m.setattr(gguf_loading, "RAW_TABLES", ())
        before = load_model(path, dtype, **kwargs).model  # type: ignore[arg-type]
    with monkeypatch.context() as m:
        m.setattr(convert, "CHUNK_ROWS", CHUNK)
        now = load_model(path, dtype, **kwargs).model  # type: ignore[arg-type]
    return before, now


def _logits(model: LanguageModel) -> torch.Tensor:
    n = len(PROMPT)
    with torch.no_grad():
        batch = FlatBatch.build([0], [0], [n], PROMPT.device)
        return model.logits(model(PROMPT, batch, model.new_cache(1, 32))).clone()


@pytest.mark.parametrize("weights", ["dequant", "auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_embedding_gives_the_same_logits(
    case: str, weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(case, tmp_path)
    before, now = _load_both(path, monkeypatch, "float32", weights)
    assert isinstance(before.embed, nn.Embedding)
    tied = now.cfg.tie_word_embeddings
    assert tied == (CASES[case][0] == "gemma3" or "tie_word_embeddings" in CASES[case][2])
    # a tied float head (dequant) is packed into its own copy, so the embedding stays in
    # blocks there too
    assert isinstance(now.embed, QuantizedEmbedding) and not list(now.embed.parameters())
    if weights == "auto" and problem() is None:
        assert isinstance(now.lm_head, LowbitLinear)  # the head's GGUF type maps to a kernel
    assert torch.equal(_logits(now), _logits(before))
    ids = torch.tensor([[0, 129], [7, 7]])
    assert torch.equal(now.embed(ids), before.embed(ids))


@pytest.mark.parametrize("case", ["q5-tied", "gemma-q8"])
def test_an_unpacked_tied_float_head_shares_the_float_table(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # dequant without packing: the head is the float table, so the embedding keeps it too
    # (nothing to save); with --weights auto the head is quantized and the table is not
    path = _write(case, tmp_path)
    before, now = _load_both(path, monkeypatch, "float32", "dequant", prepack=False)
    assert isinstance(now.embed, nn.Embedding)
    assert now.lm_head.weight.data_ptr() == now.embed.weight.data_ptr()  # one float table
    assert torch.equal(_logits(now), _logits(before))
    before, now = _load_both(path, monkeypatch, "float32", "auto", prepack=False)
    assert isinstance(now.embed, QuantizedEmbedding)
    assert torch.equal(_logits(now), _logits(before))


@pytest.mark.parametrize(
    ("case", "dtype", "weights"),
    [
        ("q8-untied", "bfloat16", "auto"),  # torch's bf16 kernels; rows cast to bf16
        ("q5-tied", "bfloat16", "auto"),
        ("gemma-q8", "bfloat16", "dequant"),
        ("q8-untied", "float64", "dequant"),  # auto is dequant under float64
        ("q5-tied", "float64", "auto"),
    ],
)
def test_other_dtypes_get_the_rows_cast_as_before(
    case: str, dtype: str, weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, now = _load_both(_write(case, tmp_path), monkeypatch, dtype, weights)
    want = {"bfloat16": torch.bfloat16, "float64": torch.float64}[dtype]
    assert now.embed(PROMPT).dtype == want == before.embed.weight.dtype
    assert now.new_cache(1, 8).k[0].dtype == want
    assert torch.equal(_logits(now), _logits(before))


@pytest.mark.parametrize("table", ["F32", "F16"])
def test_float_tables_keep_nn_embedding(table: str, tmp_path: Path) -> None:
    hf = make_hf_model("qwen2", seed=2)
    tables = {} if table == "F32" else {"token_embd.weight": "F16"}
    path = write_gguf(hf, "qwen2", tmp_path / "m.gguf", tables)
    for weights in ("dequant", "auto"):
        model = load_model(path, with_tokenizer=False, weights=weights).model
        assert type(model.embed) is nn.Embedding and model.embed.weight.dtype == torch.float32


@needs_lowbit
def test_runner_on_a_quantized_embedding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the runner takes the activations' dtype and device from the embedding, and its empty
    # hidden-state rows (for the mtp speculator) have the model's width
    before, now = _load_both(_write("q8-untied", tmp_path), monkeypatch, "float32", "auto")
    work = [SlotInput(0, [1, 2, 3, 4], 2), SlotInput(1, [5, 6, 129], 3)]
    runners = [ModelRunner(m, 2, 64) for m in (before, now)]
    want, got = (r.forward(work) for r in runners)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    _, rows = runners[1].take_hidden(0)
    assert rows.shape == (0, now.cfg.hidden_size) and rows.dtype == torch.float32


@needs_lowbit
@pytest.mark.parametrize("mode", ["int8", "int5", "int4"])
def test_a_head_quantized_in_row_chunks_has_the_records_of_the_whole(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(VOCAB, 64, generator=g), torch.randn(VOCAB, generator=g)
    whole = quantize_weight(weight, bias, mode, lowbit=True)
    blocks = gguf_blocks(weight.numpy(), "Q8_0")
    table = QuantizedTable(torch.from_numpy(blocks), "Q8_0", 64)
    from_table = quantize_weight(table.dequantize(), None, mode, lowbit=True)
    for chunk in (8, CHUNK, 128):
        parts = convert.quantize_rows(weight, bias, mode, True, chunk)
        assert type(parts) is type(whole) and isinstance(parts, LowbitLinear)
        assert torch.equal(parts.records, whole.records)
        assert torch.equal(parts.bias, whole.bias)
        assert (parts.out_features, parts.in_features) == (VOCAB, 64)
        x = torch.randn(3, 64, generator=g)
        assert torch.equal(parts(x), whole(x))
        chunked = convert.quantize_rows(table, None, mode, True, chunk)
        assert torch.equal(chunked.records, from_table.records)
    with pytest.raises(ValueError, match="whole tiles"):
        convert.quantize_rows(weight, None, mode, True, 12)


@pytest.mark.parametrize("weights", ["dequant", "auto"])
@pytest.mark.parametrize("tied", [False, True])
def test_hybrid_gguf_with_a_quantized_embedding(
    tied: bool, weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Qwen3.5 with its MTP layer: the mtp speculator looks tokens up in the target's embedding
    hf = make_hybrid_model("qwen3_5", seed=4, vocab_size=VOCAB, tie_word_embeddings=tied)
    tables = {"token_embd.weight": "Q8_0"} | ({} if tied else {"output.weight": "Q5_0"})
    path = write_hybrid_gguf(hf, "qwen3_5", tmp_path / "h.gguf", mtp_tensors(hf, 5), tables)
    before, now = _load_both(path, monkeypatch, "float32", weights)
    assert isinstance(now.embed, QuantizedEmbedding)  # a tied float head is packed
    assert now.mtp is not None
    assert torch.equal(_logits(now), _logits(before))
    assert torch.equal(now.embed(PROMPT), before.embed(PROMPT))


def test_mtp_speculation_on_a_quantized_embedding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the mtp speculator feeds the target's embedding of the drafted tokens to the MTP head;
    # greedy output with it equals output without it, and the float-table model's
    from specserve.engine.engine import Engine
    from specserve.engine.request import Request, SpecParams
    from specserve.engine.sampling import SamplingParams
    from specserve.speculative.cost import ForwardCost
    from specserve.speculative.registry import build_speculator

    hf = make_hybrid_model("qwen3_5", seed=4, vocab_size=VOCAB)
    path = write_hybrid_gguf(
        hf, "qwen3_5", tmp_path / "h.gguf", mtp_tensors(hf, 5), {"token_embd.weight": "Q8_0"}
    )
    before, now = _load_both(path, monkeypatch, "float32", "auto")
    assert isinstance(now.embed, QuantizedEmbedding)
    prompt = PROMPT.tolist() * 2

    drafted = []

    def greedy(model: LanguageModel, mtp: bool) -> list[int]:
        runner = ModelRunner(model, 1, 128)
        spec = build_speculator(["mtp"], None, 0.3, target=runner) if mtp else None
        req = Request(prompt, SamplingParams(temperature=0, max_tokens=40), SpecParams(4, 0, 0.0))
        # free verify rows: the random head is unsure of every draft, and rows priced as
        # measured would cut them all (its tiers start from its own probability)
        Engine(runner, spec, cost=ForwardCost(measure=False, per_row=0.0)).generate([req])
        if spec is not None:
            drafted.append(spec.stats.tokens_generated)
        return req.output

    want = greedy(before, False)
    assert len(want) == 40
    assert greedy(now, False) == want
    assert greedy(now, True) == want
    assert drafted[0] > 0  # the MTP head did draft (from QuantizedEmbedding rows)
