"""Property-based requests from the served /openapi.json (schemathesis): whatever the
schema allows a client to send, the server answers without a 5xx (tiny float64 model).
CI runs a few examples per route; the slow variant many more."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from specserve.loading.model import LoadedModel
from tests.server.conftest import start_server

FEW, MANY = 6, 150


@pytest.fixture(scope="module")
def api_schema(tiny_model: LoadedModel) -> Iterator[schemathesis.BaseSchema]:
    server = start_server(tiny_model, parallel=2, spec_types=("ngram-map-k", "suffix"))
    yield schemathesis.openapi.from_url(server.url + "/openapi.json")
    server.stop()


def _no_server_error(case: schemathesis.Case) -> None:
    response = case.call(timeout=120)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:  # every refusal in OpenAI's shape
        assert response.json()["error"]["message"]


def _every_operation(api_schema: schemathesis.BaseSchema, examples: int) -> list[str]:
    """Hypothesis draws `examples` cases per operation of the schema; returns their names."""
    names = []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        names.append(operation.label)

        @given(case=operation.as_strategy())
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,  # no example database written into the tree
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            _no_server_error(case)

        check()
    return names


def test_generated_requests_get_no_server_error(api_schema: schemathesis.BaseSchema) -> None:
    names = _every_operation(api_schema, FEW)
    assert "POST /v1/chat/completions" in names and "GET /health" in names


@pytest.mark.slow
def test_many_generated_requests_get_no_server_error(
    api_schema: schemathesis.BaseSchema,
) -> None:
    _every_operation(api_schema, MANY)
