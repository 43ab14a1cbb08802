"""Benchmark: what quantized weights cost in quality, against float32-dequantized weights.

    specserve bench quality --models qwen2.5-coder-0.5b --weights int8 int4 auto bfloat16+int8

A weights entry is WEIGHTS or DTYPE+WEIGHTS; float32 (the default) runs specserve's own
low-bit kernels (int8 activations too, as llama.cpp does), bfloat16 torch's kernels.

For 3 fixed chat prompts (plain text for a base model) the float32 model's greedy
continuation (128 tokens) is the reference. Each weights mode then reads prompt + reference
in one forward (teacher forcing) and we count the positions where its argmax equals the
reference token ("agreement"); "same prefix" is how many tokens free-running greedy
decoding reproduces before the first difference (one early flip changes everything after
it, so it is the harsher number).
"""

from __future__ import annotations

import argparse

import torch

from specserve.engine.engine import Engine
from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner, SlotInput
from specserve.engine.sampling import SamplingParams
from specserve.loading.model import LoadedModel, load_model
from specserve.loading.tokenizer import Tokenizer

PROMPTS = (
    "Write a quicksort function in C.",
    "Explain what a mutex is, in a short paragraph.",
    "Write a Python class for a stack with push, pop and peek.",
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b"])
    p.add_argument("--weights", nargs="+", default=["int8", "int4", "auto"])
    p.add_argument("--tokens", type=int, default=128, help="reference tokens per prompt")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")


def greedy(loaded: LoadedModel, prompt: list[int], n: int) -> list[int]:
    engine = Engine(ModelRunner(loaded.model, 1, len(prompt) + n + 1))
    req = Request(prompt, SamplingParams(temperature=0, max_tokens=n), SpecParams(n_max=0))
    engine.generate([req])
    return req.output


def agreement(loaded: LoadedModel, prompt: list[int], ref: list[int]) -> float:
    """Share of reference positions where the model's argmax is the reference token."""
    runner = ModelRunner(loaded.model, 1, len(prompt) + len(ref) + 1)
    seq = prompt + ref
    (logits,) = runner.forward([SlotInput(0, seq[:-1], len(ref))])
    return float((logits.argmax(-1) == torch.tensor(ref)).float().mean())


def same_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def prompt_ids(tok: Tokenizer, text: str) -> list[int]:
    """A prompt through the chat template, or as plain text for a base model (Gemma 3
    270M has no template: it continues the text instead)."""
    if tok.has_chat_template:
        return tok.chat([{"role": "user", "content": text}])
    return tok.encode(text)


def main(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{'model':>20} | {'weights':>14} | {'agreement':>9} | "
        f"same prefix (of {args.tokens}) per prompt"
    )
    for name in args.models:
        ref_model = load_model(name, "float32")
        tok = ref_model.tokenizer
        assert tok is not None
        prompts = [prompt_ids(tok, p) for p in PROMPTS]
        refs = [greedy(ref_model, p, args.tokens) for p in prompts]
        del ref_model
        for weights in args.weights:
            dtype, _, mode = weights.rpartition("+")
            quant = load_model(name, dtype or "float32", weights=mode, with_tokenizer=False)
            agree = [agreement(quant, p, r) for p, r in zip(prompts, refs, strict=True)]
            prefix = [
                same_prefix(greedy(quant, p, args.tokens), r)
                for p, r in zip(prompts, refs, strict=True)
            ]
            mean = sum(agree) / len(agree)
            print(f"{name:>20} | {weights:>14} | {mean:>9.1%} | {prefix}", flush=True)
