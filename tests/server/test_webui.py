"""The chat page's server side: / and its files, with an API key, allowed hosts, and
--no-webui (the page itself: test_webui_browser.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import pytest

from specserve.loading.model import LoadedModel
from specserve.server.chat_page import FILES
from specserve.server.transport import TransportLimits
from tests.server.conftest import LiveServer, start_server

KEY = "sekret"


@pytest.fixture(scope="module")
def keyed(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    limits = TransportLimits(allowed_hosts=("127.0.0.1",))
    server = start_server(tiny_model, parallel=1, api_key=KEY, limits=limits)
    yield server
    server.stop()


def test_the_page_and_its_files_are_served(live: LiveServer) -> None:
    page = httpx2.get(live.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for name, media in FILES.items():
        if name != "index.html":
            assert f'"/webui/{name}"' in page.text  # the page loads every file listed
        got = httpx2.get(f"{live.url}/webui/{name}", timeout=10)
        assert got.status_code == 200 and got.headers["content-type"] == media
        assert got.headers["x-content-type-options"] == "nosniff"
    assert httpx2.get(live.url + "/webui/../app.py", timeout=10).status_code == 404
    assert httpx2.get(live.url + "/webui/secret.txt", timeout=10).status_code == 404
    schema = httpx2.get(live.url + "/openapi.json", timeout=10).json()
    assert "/" not in schema["paths"]  # the page is not part of the API


def test_with_an_api_key_the_page_loads_and_the_api_asks_for_the_key(keyed: LiveServer) -> None:
    for path in ["/", *(f"/webui/{name}" for name in FILES)]:
        assert httpx2.get(keyed.url + path, timeout=10).status_code == 200, path
    assert httpx2.get(keyed.url + "/v1/models", timeout=10).status_code == 401
    assert httpx2.get(keyed.url + "/webui/other.js", timeout=10).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx2.get(keyed.url + "/v1/models", headers=auth, timeout=10).status_code == 200
    # the Host check (DNS rebinding) covers the page as well
    evil = httpx2.get(keyed.url + "/", headers={"Host": "evil.example"}, timeout=10)
    assert evil.status_code == 400 and evil.json()["error"]["code"] == "invalid_host"


def test_no_webui_is_a_404(tiny_model: LoadedModel) -> None:
    server = start_server(tiny_model, parallel=1, webui=False)
    try:
        for path in ("/", "/webui/app.js"):
            got = httpx2.get(server.url + path, timeout=10)
            assert got.status_code == 404 and "error" in got.json()
        assert httpx2.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()
