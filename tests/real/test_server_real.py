"""llama.cpp's own review scenario for parallel drafting (#22838), on the real 0.5B through
`specserve serve` (a subprocess with the served defaults: 4 slots, --weights auto, the default
speculator chain) and the openai client: three quicksort prompts, greedy, run one after
another, again, then all three at once; every run gives the first run's text, and so does
each request with speculation turned off in its body."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from specserve.bench.server_process import MODEL_ID, ServerProcess, ServerSpec
from specserve.server.cli_args import DEFAULT_SPEC

PROMPT = "Write a quicksort demo in {}. Please, write just code. Do not write any extra comments."
LANGS = ("C", "Java", "Python")
MAX_TOKENS = 160


def _ask(api: openai.OpenAI, lang: str, speculate: bool = True) -> tuple[str, int]:
    """The reply's text and its timings' draft_n."""
    extra = {} if speculate else {"speculative": {"types": []}}
    reply = api.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": PROMPT.format(lang)}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body=extra,
    )
    text = reply.choices[0].message.content
    assert text is not None
    return text, reply.timings["draft_n"]  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.smoke
def test_quicksort_sequential_again_parallel_and_unspeculated_agree(
    qwen05_path: Path, tmp_path: Path
) -> None:
    spec = ServerSpec(model=str(qwen05_path), slots=4, spec_type=DEFAULT_SPEC, threads=2)
    with ServerProcess(spec, tmp_path / "server.log") as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        first = [_ask(api, lang) for lang in LANGS]
        again = [_ask(api, lang) for lang in LANGS]
        with ThreadPoolExecutor(len(LANGS)) as pool:
            parallel = list(pool.map(lambda lang: _ask(api, lang), LANGS))
        plain = [_ask(api, lang, speculate=False) for lang in LANGS]
    texts = [text for text, _ in first]
    assert len(set(texts)) == len(LANGS)  # three different programs
    assert [t for t, _ in again] == texts
    assert [t for t, _ in parallel] == texts
    assert [t for t, _ in plain] == texts
    assert sum(n for _, n in first + again + parallel) > 0  # speculation drafted
    assert all(n == 0 for _, n in plain)
