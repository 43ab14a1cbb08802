"""The prompt store over HTTP: with 2 slots and 3 conversations taking turns, every
returning turn reports its history in `usage.prompt_tokens_details.cached_tokens`, and
/metrics counts the store's hits and bytes (tiny float64 model)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from specserve.cache.store import PromptStore
from specserve.loading.model import LoadedModel
from tests.server.conftest import MODEL_ID, LiveServer, start_server
from tests.server.test_openai_api import client, metrics

HITS = 'specserve:prompt_store_hits_total{model_name="tiny"}'
BYTES = 'specserve:prompt_store_bytes{model_name="tiny"}'


@pytest.fixture(scope="module")
def two_slots(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    server = start_server(tiny_model, parallel=2)
    server.loop.engine.prompts.use_store(PromptStore(2**26, block=16))  # before any request
    yield server
    server.stop()


def _turn(server: LiveServer, messages: list[dict[str, str]]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of the conversation's next turn."""
    out = client(server).chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    messages.append({"role": "assistant", "content": out.choices[0].message.content or ""})
    return out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens or 0


def test_returning_conversations_are_cached_beyond_the_slots(two_slots: LiveServer) -> None:
    before = metrics(two_slots)
    assert before[HITS] == 0
    convs = [[{"role": "user", "content": f"{i} conversation, " + "words " * 12}] for i in range(3)]
    first = [_turn(two_slots, c) for c in convs]
    assert all(cached <= len("<user>") for _, cached in first)  # the template's tag at most
    for i, conv in enumerate(convs):
        conv.append({"role": "user", "content": f"and a follow-up for {i}"})
        _, cached = _turn(two_slots, conv)
        # all of turn 1's prompt, and its answer, came back from a slot or the store
        assert cached > first[i][0], f"conversation {i}: {cached} cached"
    after = metrics(two_slots)
    assert after[HITS] >= 2  # two of three had left their slots for the store
    assert 0 < after[BYTES] <= 2**26
