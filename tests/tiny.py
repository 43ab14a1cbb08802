"""Tiny random-weight models written by the tests, in the real HF layout."""

from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB = 128


def device_under_test() -> torch.device:
    """Where the exactness tests put their tiny models: the CPU, or the device
    `SPECSERVE_TEST_DEVICE` names (`cuda` on a lent GPU; CI has none)."""
    return torch.device(os.environ.get("SPECSERVE_TEST_DEVICE", "cpu"))


def add_noise(model: torch.nn.Module, scale: float, seed: int = 5) -> None:
    """Every weight plus `scale` of its own spread in noise, the same on any device."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
            p.add_(noise * scale * p.std())


def hf_config(arch: str, **overrides):  # noqa: ANN003, ANN201 (a transformers config)
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=2.0**-20,  # exact in float32, as GGUF stores it
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**{**common, "rope_theta": 500000.0, **overrides})
    if arch == "qwen2":
        return Qwen2Config(**{**common, "rope_theta": 1e6, **overrides})
    if arch == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 32, "rope_theta": 1e6, **overrides})
    if arch == "gemma3":
        gemma = {
            **common,
            "num_hidden_layers": 4,
            "tie_word_embeddings": True,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 6,
            "layer_types": ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
        }
        return Gemma3TextConfig(**{**gemma, **overrides})
    raise ValueError(arch)


def make_hf_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:  # noqa: ANN003
    """A float64 transformers model with random weights (norm weights randomised too)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = AutoModelForCausalLM.from_config(
            hf_config(arch, **overrides), attn_implementation="sdpa"
        )
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) * 0.5 + (0.0 if arch == "gemma3" else 0.75))
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def write_hf_folder(arch: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    model = make_hf_model(arch, seed)
    model.save_pretrained(str(folder))
    return model


CHAR_END = 1  # write_tokenizer's <|endoftext|>


def char_tokenizer():  # noqa: ANN201 (a Tokenizer)
    """write_tokenizer's tokenizer, loaded (once per process)."""
    import tempfile

    from specserve.loading.tokenizer import load_tokenizer

    global _CHAR_TOKENIZER
    if _CHAR_TOKENIZER is None:
        folder = Path(tempfile.mkdtemp(prefix="char-tokenizer-"))
        write_tokenizer(folder)
        _CHAR_TOKENIZER = load_tokenizer(folder)
    return _CHAR_TOKENIZER


_CHAR_TOKENIZER = None


def constraint(kind: str = "json_object", source: object = None):  # noqa: ANN201
    """A GrammarConstraint over the char tokenizer's ids (32..126 spell their ASCII
    character; CHAR_END ends the reply)."""
    from specserve.grammar.constraint import build_constraint
    from specserve.grammar.formats import Grammar

    return build_constraint(char_tokenizer(), VOCAB, Grammar(kind, source))  # type: ignore[arg-type]


def write_tokenizer(folder: Path, line_break: bool = False) -> None:
    """A character-level tokenizer over the tiny vocab (ids 32..126 are printable ASCII;
    with `line_break`, id 10 is "\\n")."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{chr(i): i for i in range(32, 127)}}
    vocab.update({"\n": 10} if line_break else {})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    char = Regex("[\\s\\S]" if line_break else ".")
    tok.pre_tokenizer = pre_tokenizers.Split(char, behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>"
    )
    fast.save_pretrained(str(folder))
