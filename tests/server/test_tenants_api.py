"""Tenants over HTTP: prompt prefixes (and so `cached_tokens`) are shared only by requests
with the same cache_salt and, with several API keys, the same key (tiny float64 model)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from specserve.loading.model import LoadedModel
from tests.server.conftest import MODEL_ID, LiveServer, start_server
from tests.server.test_openai_api import client

HELLO = [{"role": "user", "content": "hello, the same words from everyone"}]


@pytest.fixture(scope="module")
def two_keys(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    server = start_server(tiny_model, api_key="key-one,key-two")
    yield server
    server.stop()


def cached(server: LiveServer, key: str, salt: str | None = None) -> int:
    extra = {} if salt is None else {"cache_salt": salt}
    out = client(server, key).chat.completions.create(
        model=MODEL_ID, messages=HELLO, max_tokens=2, temperature=0, extra_body=extra
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.usage.prompt_tokens_details.cached_tokens or 0


def test_each_key_and_salt_is_its_own_tenant(two_keys: LiveServer) -> None:
    assert cached(two_keys, "key-one") == 0
    assert cached(two_keys, "key-one") > 0  # the same tenant reuses its prefix
    assert cached(two_keys, "key-two") == 0  # another key: nothing learnt from key-one
    assert cached(two_keys, "key-one", salt="team-a") == 0
    assert cached(two_keys, "key-one", salt="team-a") > 0
    assert cached(two_keys, "key-two", salt="team-a") == 0  # a salt is no way into a key


def test_either_key_is_served_and_others_refused(two_keys: LiveServer) -> None:
    import openai

    assert [m.id for m in client(two_keys, "key-two").models.list()] == [MODEL_ID]
    with pytest.raises(openai.AuthenticationError):
        client(two_keys, "key-one,key-two").models.list()
