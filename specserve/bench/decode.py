"""Benchmark: prefill and decode speed, and what a k-token forward costs relative to one token.

    specserve bench decode --models qwen2.5-coder-0.5b qwen2.5-coder-1.5b \
        --variants float32 float32+unpacked bfloat16 bfloat16+int8 bfloat16+int4

Speculative decoding pays when verifying k drafted tokens costs about one decode step; the
`k=N` columns show that ratio (time of one forward over N new tokens / time over 1).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from specserve.engine.runner import ModelRunner, SlotInput

KS = (1, 2, 4, 8, 16)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b"], help="names or paths")
    p.add_argument(
        "--variants",
        nargs="+",
        default=["float32", "bfloat16", "bfloat16+int8", "bfloat16+int4"],
        help="DTYPE or DTYPE+WEIGHTS (weights: int8, int5, int4, auto; default dequant; "
        "`unpacked`: float weights on F.linear, not oneDNN's pre-packed ones)",
    )
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens for prefill")
    p.add_argument("--decode-len", type=int, default=64, help="tokens to decode")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per k")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the rows as JSON")


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(runner: ModelRunner, prompt_len: int, decode_len: int, repeats: int) -> dict:
    """One model: prefill tok/s, greedy decode tok/s, and k-token forward cost ratios."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, runner.vocab_size, (prompt_len,), generator=g).tolist()
    mem = runner.memory
    runner.prefill(0, prompt[:32])  # warm-up
    mem.free(0)
    t_prefill = _timed(lambda: runner.prefill(0, prompt))
    last = prompt[-1]

    def decode() -> None:
        nonlocal last
        for _ in range(decode_len):
            (lg,) = runner.forward([SlotInput(0, [last])])
            last = int(lg[-1].argmax())

    t_decode = _timed(decode)
    base = mem.length(0)
    cost = {}
    for k in KS:
        times = []
        for _ in range(repeats + 1):
            mem.commit(0, base)
            times.append(_timed(lambda k=k: runner.forward([SlotInput(0, prompt[:k], k)])))
        cost[k] = statistics.median(times[1:])
    return {
        "prefill_tok_s": prompt_len / t_prefill,
        "decode_tok_s": decode_len / t_decode,
        **{f"k={k}": cost[k] / cost[1] for k in KS},
        "ms_k1": cost[1] * 1e3,
    }


def main(args: argparse.Namespace) -> None:
    from specserve.loading.model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        for variant in args.variants:
            dtype, _, weights = variant.partition("+")
            loaded = load_model(
                name,
                dtype,
                with_tokenizer=False,
                progress=True,
                weights="dequant" if weights in ("", "unpacked") else weights,
                prepack=weights != "unpacked",
            )
            ctx = args.prompt_len + args.decode_len + max(KS) + 8
            runner = ModelRunner(loaded.model, num_slots=1, max_len=ctx)
            row = {
                "model": name,
                "dtype": variant,
                **measure(runner, args.prompt_len, args.decode_len, args.repeats),
            }
            row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            rows.append(row)
            print_table(rows[-1:], header=len(rows) == 1)
            del loaded, runner
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))


def print_table(rows: list[dict], header: bool = True) -> None:
    cols = [
        "model",
        "dtype",
        "prefill_tok_s",
        "decode_tok_s",
        "ms_k1",
        *[f"k={k}" for k in KS],
        "peak_rss_mb",
    ]
    if header:
        print(" | ".join(f"{c:>20}" if i < 2 else f"{c:>13}" for i, c in enumerate(cols)))
    for r in rows:
        cells = [f"{r[c]:>20}" if i < 2 else f"{r[c]:>13.2f}" for i, c in enumerate(cols)]
        print(" | ".join(cells), flush=True)
