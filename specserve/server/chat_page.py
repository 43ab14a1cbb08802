"""GET /: the chat page, a single-page client shipped in the package (server/webui/: plain
HTML, CSS and JavaScript; no build step, nothing fetched from elsewhere).

The page and its files are served without the API key, so that a browser can load the page
that then asks for the key; they hold nothing secret. Everything the page does afterwards
goes through the API with the key as a bearer token. A strict Content-Security-Policy keeps
the page to this server: no inline script, no other origin, no framing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI, Response

# file -> media type; the page loads exactly these
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
}
# what the transport middleware serves without a key
PATHS = frozenset({"/", *(f"/webui/{name}" for name in FILES)})
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return (resources.files("specserve.server") / "webui" / name).read_bytes()


def add_chat_page(app: FastAPI) -> None:
    """Serve the page at / and its files at /webui/NAME (read once, here)."""
    files = {name: _read(name) for name in FILES}

    def route(name: str) -> Callable[[], Awaitable[Response]]:
        async def serve() -> Response:
            return Response(files[name], media_type=FILES[name], headers=HEADERS)

        return serve

    # one route per file and no path parameter: no other name can be asked for
    app.add_api_route("/", route("index.html"), methods=["GET"], include_in_schema=False)
    for name in FILES:
        app.add_api_route(f"/webui/{name}", route(name), methods=["GET"], include_in_schema=False)
