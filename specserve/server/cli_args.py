"""`specserve serve`: its flags, and turning them into a running server.

`specserve.cli` adds the subcommand with `add_serve_args(parser)` and calls
`run_serve(args)`; `python -m specserve.server.cli_args ...` runs the same thing alone.
Flags follow llama.cpp's server where it has one (-np, --ctx-size, --draft-max, ...).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from specserve.engine.flags import add_engine_args, settings_from_args, spec_defaults_from_args
from specserve.engine.request import SpecParams
from specserve.engine.setup import build_engine
from specserve.engine.threads import ComputeThread
from specserve.errors import SpecserveError
from specserve.loading.model import LoadedModel
from specserve.server.app import ServerConfig, build_app
from specserve.server.health import DEFAULT_STALL_TIMEOUT
from specserve.server.loop import EngineLoop
from specserve.server.request_id import RequestIdFilter
from specserve.server.transport import (
    BODY_BYTES_PER_TOKEN,
    MIB,
    MIN_BODY,
    TransportLimits,
    default_max_body,
    uvicorn_config,
)

# needs no draft model (see `specserve bench spec`); `prediction` drafts only for requests
# that send OpenAI's `prediction`
DEFAULT_SPEC = "ngram-map-k,suffix,prediction"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, DEFAULT_SPEC, slots=4)
    p.add_argument("--alias", default=None, help="the model id clients send (default: --model)")
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    h.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    h.add_argument(
        "--api-key",
        default=os.environ.get("SPECSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY'; several keys comma-separated, each its own "
        "tenant (no prompt cache or drafting knowledge shared between keys) (default: "
        "$SPECSERVE_API_KEY, else none)",
    )
    h.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait for a slot; more get 503 + Retry-After (default 64)",
    )
    h.add_argument(
        "--stall-timeout",
        type=float,
        default=DEFAULT_STALL_TIMEOUT,
        help="/health answers 503 'stalled' when the engine has work but has finished no step "
        f"for this many seconds (default {DEFAULT_STALL_TIMEOUT:.0f})",
    )
    h.add_argument(
        "--no-webui",
        dest="webui",
        action="store_false",
        help="do not serve the chat page at / (default: served, without the API key; the "
        "page asks for the key and sends it with every request)",
    )
    _add_limit_args(p)


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("http limits")
    h.add_argument(
        "--max-body-mb",
        type=float,
        default=None,
        help="largest request body in MiB; a larger declared body gets 413 before it is read, "
        f"a chunked one once it passes the limit (default: room for a prompt filling the "
        f"context, {BODY_BYTES_PER_TOKEN} bytes per --ctx-size token, at least "
        f"{MIN_BODY >> 20} MiB)",
    )
    h.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a request's line and headers, from connecting or "
        "from its first byte; slower connections are closed (slowloris) (default 10)",
    )
    h.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may stall between two reads before a 408 (default 30)",
    )
    h.add_argument(
        "--keep-alive-timeout",
        type=int,
        default=5,
        help="seconds an idle connection stays open between requests (default 5)",
    )
    h.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="open connections plus running requests beyond which uvicorn answers 503 "
        "(default: no limit; --max-queue bounds the requests waiting for a slot)",
    )
    h.add_argument(
        "--drain-timeout",
        type=int,
        default=25,
        help="after SIGTERM, seconds running requests (and half-sent bodies) get before they "
        "are cut off; keep it under the orchestrator's grace period, 30 s in Kubernetes "
        "(default 25)",
    )
    h.add_argument(
        "--allowed-hosts",
        type=_hosts,
        default=None,
        help="comma-separated Host header names to serve, '*.example.com' for subdomains; "
        "others get 400, against DNS rebinding; /health is exempt for probes "
        "(default: any host)",
    )
    h.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without the API key (default: /metrics needs --api-key's key "
        "when one is set)",
    )


def _hosts(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    if not hosts:
        raise argparse.ArgumentTypeError("no host names in --allowed-hosts")
    return hosts


def transport_limits(args: argparse.Namespace, max_len: int) -> TransportLimits:
    """The http limit flags; the body limit's default fits a context of max_len tokens."""
    mb = args.max_body_mb
    return TransportLimits(
        max_body=int(mb * MIB) if mb is not None else default_max_body(max_len),
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        limit_concurrency=args.limit_concurrency,
        drain_timeout=args.drain_timeout,
        allowed_hosts=args.allowed_hosts,
        metrics_public=args.metrics_public,
    )


def build_server(args: argparse.Namespace) -> tuple[EngineLoop, ServerConfig, LoadedModel]:
    """Load the model(s) and build the engine loop and HTTP settings the flags describe.

    The loading runs on the thread that will step the engine, so the process keeps one
    OpenMP team (engine/threads.py ComputeThread says why)."""
    defaults = spec_defaults_from_args(args)  # ValueError if bad
    settings = settings_from_args(args)
    compute = ComputeThread()
    try:
        engine, loaded = compute.call(build_engine, settings)
        if loaded.tokenizer is None:
            raise SpecserveError(f"{loaded.path} has no tokenizer files")
    except BaseException:
        compute.close()
        raise
    loop = EngineLoop(engine, args.max_queue, compute, stall_timeout=args.stall_timeout)
    speculating = engine.speculator is not None
    cfg = ServerConfig(
        model_id=args.alias or args.model,
        api_key=args.api_key or None,
        spec_types=settings.spec_types if speculating else (),
        spec_defaults=defaults if speculating else SpecParams(n_max=0),
        drain_timeout=args.drain_timeout,
        transport=transport_limits(args, engine.max_len),
        webui=args.webui,
    )
    return loop, cfg, loaded


def run_serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM / Ctrl-C; then stop accepting, drain running requests, exit."""
    import uvicorn

    handler = logging.StreamHandler()
    # the id of the request being handled ("-" outside one) in every line
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(
        logging.Formatter("%(levelname)s:     specserve [%(request_id)s]: %(message)s")
    )
    logging.getLogger("specserve").addHandler(handler)
    logging.getLogger("specserve").setLevel(logging.INFO)
    loop, cfg, loaded = build_server(args)
    assert loaded.tokenizer is not None
    app = build_app(loop, loaded.tokenizer, cfg)
    slots, ctx = loop.num_slots, loop.engine.max_len
    logging.getLogger("specserve").info(
        "serving %s: %d slots x %d tokens, speculative types: %s",
        cfg.model_id,
        slots,
        ctx,
        ",".join(cfg.spec_types) or "none",
    )
    if cfg.webui:
        logging.getLogger("specserve").info("chat page: http://%s:%d/", args.host, args.port)
    config = uvicorn_config(app, cfg.transport, host=args.host, port=args.port, log_level="info")
    uvicorn.Server(config).run()  # handles SIGINT/SIGTERM: graceful shutdown, then lifespan


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve serve", description=__doc__)
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        run_serve(args)
    except (SpecserveError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
