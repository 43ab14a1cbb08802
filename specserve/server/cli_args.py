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
from specserve.server.loop import EngineLoop

# needs no draft model (see `specserve bench spec`); `prediction` drafts only for requests
# that send OpenAI's `prediction`
DEFAULT_SPEC = "ngram-map-k,suffix,prediction"

DRAIN_TIMEOUT_S = 30.0  # SIGTERM: how long running requests may take to finish


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, DEFAULT_SPEC, slots=4)
    p.add_argument("--alias", default=None, help="the model id clients send (default: --model)")
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    h.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    h.add_argument(
        "--api-key",
        default=os.environ.get("SPECSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $SPECSERVE_API_KEY, else none)",
    )
    h.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait for a slot; more get 503 + Retry-After (default 64)",
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
    loop = EngineLoop(engine, args.max_queue, compute)
    speculating = engine.speculator is not None
    cfg = ServerConfig(
        model_id=args.alias or args.model,
        api_key=args.api_key or None,
        spec_types=settings.spec_types if speculating else (),
        spec_defaults=defaults if speculating else SpecParams(n_max=0),
        drain_timeout=DRAIN_TIMEOUT_S,
    )
    return loop, cfg, loaded


def run_serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM / Ctrl-C; then stop accepting, drain running requests, exit."""
    import uvicorn

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     specserve: %(message)s"))
    logging.getLogger("specserve").addHandler(handler)
    logging.getLogger("specserve").setLevel(logging.INFO)
    loop, cfg, loaded = build_server(args)
    assert loaded.tokenizer is not None
    app = build_app(loop, loaded.tokenizer, cfg)
    slots, ctx = loop.num_slots, loop.engine.runner.memory.max_len
    logging.getLogger("specserve").info(
        "serving %s: %d slots x %d tokens, speculative types: %s",
        cfg.model_id,
        slots,
        ctx,
        ",".join(cfg.spec_types) or "none",
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=int(DRAIN_TIMEOUT_S),
    )
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
