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

from specserve.engine.request import SpecParams
from specserve.engine.setup import EngineSettings, build_engine
from specserve.errors import SpecserveError
from specserve.loading.model import LoadedModel
from specserve.server.app import ServerConfig, build_app
from specserve.server.loop import EngineLoop
from specserve.spec.registry import parse_types

DEFAULT_SPEC = "ngram-map-k,suffix"  # needs no draft model; see `specserve bench spec`

DRAIN_TIMEOUT_S = 30.0  # SIGTERM: how long running requests may take to finish


def add_serve_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        "-m",
        default="qwen2.5-coder-0.5b",
        help="a model name, a .gguf file or an HF folder (default qwen2.5-coder-0.5b)",
    )
    m.add_argument("--alias", default=None, help="the model id clients send (default: --model)")
    m.add_argument(
        "--dtype",
        default="float32",
        choices=["float64", "float32", "bfloat16"],
        help="compute dtype (default float32)",
    )
    m.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    m.add_argument(
        "--ctx-size", "-c", type=int, default=0, help="context per slot (default min(model, 4096))"
    )
    m.add_argument("--parallel", "-np", type=int, default=4, help="parallel slots (default 4)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument(
        "--spec-type",
        default=DEFAULT_SPEC,
        help="comma-separated speculator types, or 'none': ngram-simple, ngram-map-k, "
        "ngram-map-k4v, ngram-mod, ngram-cache, suffix, draft (needs --draft-model); "
        f"several make a chain that picks the best draft per slot (default {DEFAULT_SPEC})",
    )
    s.add_argument(
        "--draft-model", "-md", default=None, help="the draft model (name, .gguf, folder)"
    )
    d = SpecParams()
    s.add_argument(
        "--draft-max", type=int, default=d.n_max, help=f"most draft tokens (default {d.n_max})"
    )
    s.add_argument(
        "--draft-min",
        type=int,
        default=d.n_min,
        help=f"shorter drafts are dropped (default {d.n_min})",
    )
    s.add_argument(
        "--draft-p-min",
        type=float,
        default=d.p_min,
        help=f"least draft probability to go on drafting (default {d.p_min})",
    )
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
    """Load the model(s) and build the engine loop and HTTP settings the flags describe."""
    defaults = SpecParams(args.draft_max, args.draft_min, args.draft_p_min)  # ValueError if bad
    settings = EngineSettings(
        model=args.model,
        dtype=args.dtype,
        device=args.device or ("cuda" if _cuda() else "cpu"),
        num_slots=args.parallel,
        ctx_size=args.ctx_size,
        spec_types=tuple(parse_types(args.spec_type)),
        draft_model=args.draft_model,
    )
    engine, loaded = build_engine(settings)
    if loaded.tokenizer is None:
        raise SpecserveError(f"{loaded.path} has no tokenizer files")
    loop = EngineLoop(engine, args.max_queue)
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
