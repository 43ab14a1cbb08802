"""Real Qwen2.5-Coder models in float32: greedy output with speculation equals output
without it, token for token, for every speculator and draft length (the contract on real
weights, where float32 rounding could in principle flip an argmax between a one-row decode
forward and a k-row verification forward; a failure message says where and by how much).

Two prompts: `rewrite`, a second turn that asks to rewrite code the conversation already
holds, so drafts copied from the context are long and mostly accepted; `plain`, a first
turn, where drafts are short and mostly rejected.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specserve.engine.request import Request, SpecParams
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.engine.setup import EngineSettings, build_engine
from specserve.speculative.base import SpecStats

N_TOKENS = 128
QUICKSORT_C = """```c
#include <stdio.h>

void swap(int* a, int* b) {
    int t = *a;
    *a = *b;
    *b = t;
}

int partition(int arr[], int low, int high) {
    int pivot = arr[high];
    int i = (low - 1);
    for (int j = low; j <= high - 1; j++) {
        if (arr[j] < pivot) {
            i++;
            swap(&arr[i], &arr[j]);
        }
    }
    swap(&arr[i + 1], &arr[high]);
    return (i + 1);
}

void quickSort(int arr[], int low, int high) {
    if (low < high) {
        int pi = partition(arr, low, high);
        quickSort(arr, low, pi - 1);
        quickSort(arr, pi + 1, high);
    }
}

int main() {
    int arr[] = {10, 7, 8, 9, 1, 5};
    int n = sizeof(arr) / sizeof(arr[0]);
    quickSort(arr, 0, n - 1);
    for (int i = 0; i < n; i++)
        printf("%d ", arr[i]);
    printf("\\n");
    return 0;
}
```"""
TURN1 = "Write a quicksort demo in C. Please, write just code. Do not write any extra comments."
CONVERSATIONS = {
    "rewrite": [
        {"role": "user", "content": TURN1},
        {"role": "assistant", "content": QUICKSORT_C},
        {"role": "user", "content": "Rewrite the same program with descriptive variable names."},
    ],
    "plain": [{"role": "user", "content": "Write a Python class for a stack with push and pop."}],
}
SPECULATORS = [
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
    "suffix",
    "ngram-map-k,suffix",
]
SMOKE = ("rewrite", "ngram-map-k,suffix", 16)
CASES = [
    pytest.param(
        *case, marks=pytest.mark.smoke if case == SMOKE else (), id="-".join(map(str, case))
    )
    for case in (
        (prompt, types, n_max)
        for prompt in CONVERSATIONS
        for types in SPECULATORS
        for n_max in (1, 4, 16, 48)
    )
]


GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS)


def run(
    target: Any,
    prompt: list[int],
    types: str,
    n_max: int,
    draft: Any = None,
    params: SamplingParams = GREEDY,
    prediction: list[int] | None = None,
) -> tuple[Request, SpecStats | None]:
    """The finished request and the speculator's statistics."""
    spec_types = tuple(types.split(",")) if types else ()
    settings = EngineSettings(ctx_size=len(prompt) + N_TOKENS + n_max + 8, spec_types=spec_types)
    engine, _ = build_engine(settings, target=target, progress=False, draft=draft)
    # drafts gated by the fixed prior, not by timings: on a busy machine the measured cost
    # of verify rows can refuse every draft, and then no accepted draft would be checked
    engine.cost.measure = False
    req = Request(prompt, params, SpecParams(n_max=n_max), prediction=prediction or [])
    engine.generate([req])
    return req, engine.speculator.stats if engine.speculator else None


def generate(
    target: Any, prompt: list[int], types: str, n_max: int, draft: Any = None
) -> tuple[list[int], SpecStats | None]:
    """Greedy tokens (exactly N_TOKENS: no stop token) and the speculator's statistics."""
    req, stats = run(target, prompt, types, n_max, draft)
    return req.output, stats


def divergence(target: Any, prompt: list[int], ref: list[int], out: list[int]) -> str:
    """Where `out` leaves the reference, and the target's logit gap there (no speculation:
    logit of the reference token minus that of the one speculation produced)."""
    i = next((j for j, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), None)
    if i is None:
        return f"lengths differ: {len(ref)} reference tokens, {len(out)} with speculation"
    runner = ModelRunner(target.model, num_slots=1, max_len=len(prompt) + i + 1)
    logits = runner.prefill(0, prompt + ref[:i]).float()
    top2 = torch.topk(logits, 2)
    return (
        f"first difference at output token {i}: reference {ref[i]}, speculation {out[i]}; "
        f"logit gap ref - spec = {float(logits[ref[i]] - logits[out[i]]):.3g} "
        f"(top-2 gap {float(top2.values[0] - top2.values[1]):.3g})"
    )


class Reference:
    """Each conversation's no-speculation output, made once per (model, conversation)."""

    def __init__(self) -> None:
        self._outputs: dict[tuple[int, str], tuple[list[int], list[int]]] = {}

    def get(self, target: Any, name: str) -> tuple[list[int], list[int]]:
        """-> (prompt ids, reference output ids)."""
        key = (id(target), name)
        if key not in self._outputs:
            prompt = target.tokenizer.chat(CONVERSATIONS[name])
            out, _ = generate(target, prompt, "", 0)
            assert len(out) == N_TOKENS
            self._outputs[key] = (prompt, out)
        return self._outputs[key]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


@pytest.mark.slow
@pytest.mark.parametrize(("prompt_name", "types", "n_max"), CASES)
def test_speculation_equals_plain_greedy_qwen05(
    prompt_name: str, types: str, n_max: int, qwen05_f32, reference, real_threads
) -> None:  # noqa: ANN001
    prompt, ref = reference.get(qwen05_f32, prompt_name)
    out, stats = generate(qwen05_f32, prompt, types, n_max)
    assert stats is not None
    assert out == ref, f"{prompt_name} {types} n_max={n_max}: " + divergence(
        qwen05_f32, prompt, ref, out
    )
    if prompt_name == "rewrite":  # the case is only worth something if drafts were kept
        assert stats.tokens_accepted > 0, stats.as_dict()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prompt_name", "types"),
    [("rewrite", "draft"), ("plain", "draft"), ("rewrite", "ngram-map-k,suffix,draft")],
    ids=["rewrite-draft", "plain-draft", "rewrite-chain-with-draft"],
)
def test_draft_model_speculation_equals_plain_greedy_qwen15(
    prompt_name: str, types: str, qwen15_f32, qwen05_f32, reference, real_threads
) -> None:  # noqa: ANN001
    """Target 1.5B, draft 0.5B (same tokenizer), both float32."""
    prompt, ref = reference.get(qwen15_f32, prompt_name)
    out, stats = generate(qwen15_f32, prompt, types, 16, draft=qwen05_f32)
    assert stats is not None and stats.tokens_accepted > 0, stats
    assert out == ref, f"{prompt_name} {types}: " + divergence(qwen15_f32, prompt, ref, out)


@pytest.mark.slow
@pytest.mark.smoke
def test_logprobs_with_speculation_equal_plain_qwen05(qwen05_auto, real_threads) -> None:  # noqa: ANN001
    """The server's weights (--weights auto): each token's logprob and top 5 from a
    verification row equal, to the bit, those of a one-row decode step."""
    prompt = qwen05_auto.tokenizer.chat(CONVERSATIONS["rewrite"])
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, logprobs=5)
    plain, _ = run(qwen05_auto, prompt, "", 0, params=params)
    fast, stats = run(qwen05_auto, prompt, "ngram-map-k,suffix", 16, params=params)
    assert stats is not None and stats.tokens_accepted > 0, stats.as_dict()
    assert fast.output == plain.output
    tok = qwen05_auto.tokenizer
    assert b"".join(tok.token_bytes(plain.output)).decode() == tok.decode(plain.output)
    differ = [
        i for i, (a, b) in enumerate(zip(plain.logprobs, fast.logprobs, strict=True)) if a != b
    ]
    worst = max(
        (abs(plain.logprobs[i].logprob - fast.logprobs[i].logprob) for i in differ), default=0
    )
    assert not differ, (
        f"{len(differ)} tokens' logprobs differ, first at {differ[0]}, max {worst:.3g}"
    )


@pytest.mark.slow
def test_predicted_output_equals_plain_greedy_qwen05(qwen05_f32, reference, real_threads) -> None:  # noqa: ANN001
    """OpenAI's Predicted Outputs on the real model: the rewrite's answer predicted as the
    first answer with some names changed; the output is the plain one, and much of it
    came from the prediction."""
    prompt, ref = reference.get(qwen05_f32, "rewrite")
    edited = QUICKSORT_C.replace("arr", "array").replace("pivot", "pv")
    prediction = qwen05_f32.tokenizer.encode_text(edited)
    req, stats = run(qwen05_f32, prompt, "prediction", 16, prediction=prediction)
    assert stats is not None
    assert req.output == ref, divergence(qwen05_f32, prompt, ref, req.output)
    assert stats.tokens_accepted >= N_TOKENS // 4, stats.as_dict()
