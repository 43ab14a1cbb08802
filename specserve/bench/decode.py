"""Benchmark: prefill and decode speed, and what a k-token forward costs relative to one token.

    specserve bench decode --models qwen2.5-coder-0.5b qwen2.5-coder-1.5b \
        --variants float32 float32+unpacked bfloat16 bfloat16+int8 bfloat16+int4

Speculative decoding pays when verifying k drafted tokens costs about one decode step; the
`k=N` columns show that ratio (time of one forward over N new tokens / time over 1).
`--llama-bench PATH` adds llama.cpp's figures on the same GGUF files, measured in the same
run (bench/llama_cpp.py); with `--paired-rounds N` both decode in turn, N rounds of one pass
each, and the per-round ratio is printed (the rows alone are minutes apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specserve.bench.args import positive, positives
from specserve.bench.lowbit_rows import (
    ROWS,
    call_groups,
    kinds_table,
    pairs_table,
    time_groups,
)
from specserve.bench.server_process import read_rss_mib, reset_peak_rss
from specserve.engine.runner import ModelRunner, SlotInput
from specserve.errors import SpecserveError
from specserve.models.layers.lowbit import kernel_isa
from specserve.models.layers.lowbit_pairs import time_pairs
from specserve.trim import release_freed_memory

KS = (1, 2, 4, 8, 16)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b"], help="names or paths")
    p.add_argument(
        "--variants",
        nargs="+",
        default=["float32", "bfloat16", "bfloat16+int8", "bfloat16+int4"],
        help="DTYPE or DTYPE+WEIGHTS (weights: int8, int6, int5, int4, auto; default dequant; "
        "`unpacked`: float weights on F.linear, not oneDNN's pre-packed ones)",
    )
    p.add_argument("--prompt-len", type=positive, default=256, help="prompt tokens for prefill")
    p.add_argument("--decode-len", type=positive, default=64, help="tokens to decode")
    p.add_argument(
        "--repeats",
        type=positive,
        default=5,
        help="timed prefills, decode passes and forwards per k (medians are reported)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda (default cpu; on cuda the variants take float weights only)",
    )
    p.add_argument("--json-out", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument(
        "--llama-bench",
        type=Path,
        default=None,
        metavar="PATH",
        help="also run llama.cpp's llama-bench at PATH on each model's GGUF file (same "
        "threads, prompt, decode and k columns) and print it as a `llama.cpp` row",
    )
    p.add_argument(
        "--paired-rounds",
        type=positive,
        default=None,
        metavar="N",
        help="with --llama-bench: also time N rounds of one decode pass of ours and one of "
        "llama.cpp's, back to back (alternating which goes first), and print the per-round "
        "ratio: both sides in the same minute of a VM whose memory speed drifts",
    )
    p.add_argument(
        "--by-kind",
        action="store_true",
        help="also time the model's low-bit calls grouped by shape and kind with 1, 2, 3, 4 "
        "and 8 rows (--repeats rounds): which weights a verify row costs most on "
        "(weights int8/int6/int5/int4/auto only)",
    )
    p.add_argument(
        "--pair-rows",
        type=positives,
        default=None,
        metavar="N,N,...",
        help="also time forwards of 1, 2, 3, 4 and 8 rows with the AVX-512 VNNI kernels "
        "pairing two tiles of weights per vector from each of these row counts (e.g. 4,1; "
        "--repeats interleaved rounds), as ratios to one row at the first: loading picks the "
        "count by timing (SPECSERVE_PAIR_ROWS sets it); the bits are the same",
    )


def _timed(runner: ModelRunner, fn) -> float:  # noqa: ANN001
    runner.sync()
    t0 = time.perf_counter()
    fn()
    runner.sync()
    return time.perf_counter() - t0


def measure(runner: ModelRunner, prompt_len: int, decode_len: int, repeats: int) -> dict:
    """One model: prefill tok/s, greedy decode tok/s and k-token forward cost ratios, each from
    the median of `repeats` timings."""
    prompt = bench_prompt(runner, prompt_len)
    mem = runner.memory
    # logits into one reused buffer, as the engine's steps write them: a new [k, vocab]
    # tensor per forward was page-faulted in each time (a visible share of a profiled
    # forward; figures: docs/perf/memory.md), which a served step never pays
    runner.reuse_logits(max(KS))
    runner.prefill(0, prompt[:32])  # warm-up
    prefills = []
    for _ in range(repeats):
        mem.free(0)
        prefills.append(_timed(runner, lambda: runner.prefill(0, prompt)))
    t_prefill = statistics.median(prefills)

    # the median of `repeats` passes from the same context, as llama-bench takes its median
    # repetition: one pass of a few seconds on a shared VM can land in a slow minute
    start = mem.length(0)
    t_decode = statistics.median(
        decode_pass(runner, start, prompt[-1], decode_len) for _ in range(repeats)
    )
    base = mem.length(0)
    times: dict[int, list[float]] = {k: [] for k in KS}
    # rounds over every k (every other one reversed), not each k's timings in a row: on a VM
    # whose speed drifts within minutes, k after k put the drift into the ratios (figures:
    # docs/perf/bench.md).
    # Round 0 is a warm-up (a row count's first forward allocates).
    for r in range(repeats + 1):
        for k in KS if r % 2 == 0 else KS[::-1]:
            mem.commit(0, base)
            t = _timed(runner, lambda k=k: runner.forward([SlotInput(0, prompt[:k], k)]))
            if r:
                times[k].append(t)
    cost = {k: statistics.median(ts) for k, ts in times.items()}
    return {
        "prefill_tok_s": prompt_len / t_prefill,
        "decode_tok_s": decode_len / t_decode,
        **{f"k={k}": cost[k] / cost[1] for k in KS},
        "ms_k1": cost[1] * 1e3,
    }


def bench_prompt(runner: ModelRunner, n: int) -> list[int]:
    """The benchmark's prompt: n random token ids, the same in every run."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, runner.vocab_size, (n,), generator=g).tolist()


def decode_pass(runner: ModelRunner, start: int, last: int, n: int) -> float:
    """Seconds for n greedy decode steps of slot 0 from context length `start`."""
    runner.memory.commit(0, start)

    def run() -> None:
        nonlocal last
        for _ in range(n):
            (lg,) = runner.forward([SlotInput(0, [last])])
            last = int(lg[-1].argmax())

    return _timed(runner, run)


def main(args: argparse.Namespace) -> None:
    from specserve.loading.model import load_model

    if args.paired_rounds and not args.llama_bench:
        raise SpecserveError("--paired-rounds needs --llama-bench (llama.cpp is the other side)")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        for variant in args.variants:
            # the previous row's model is gone, its pages back with the OS, before this row's
            # peak starts (glibc keeps freed pages otherwise: Gemma's row showed the 1.5B's)
            release_freed_memory()
            fresh = reset_peak_rss()
            dtype, _, weights = variant.partition("+")
            loaded = load_model(
                name,
                dtype,
                device=args.device,
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
            row["peak_rss_mb"] = peak_mib() if fresh else None
            rows.append(row)
            print_table(rows[-1:], header=len(rows) == 1)
            if args.paired_rounds:  # main checked that --llama-bench came with it
                rows.append(_paired_row(name, variant, runner, args))
                print_paired(rows[-1])
            if args.by_kind:
                print_by_kind(name, variant, loaded.model, args.repeats)
            if args.pair_rows:
                print_pairs(name, variant, runner, args)
            del loaded, runner
        if args.llama_bench:
            rows.append(_llama_cpp_row(name, args))
            print_table(rows[-1:], header=len(rows) == 1)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))


def print_by_kind(name: str, variant: str, model: torch.nn.Module, rounds: int) -> None:
    """The model's low-bit calls by shape and kind at 1-8 rows (bench/lowbit_rows.py)."""
    groups = call_groups(model)
    if not groups:
        print(f"[{name} {variant}] no low-bit calls: --by-kind needs int8/int6/int5/int4/auto")
        return
    print(f"[{name} {variant}] low-bit calls by shape and kind, ms per forward:", flush=True)
    print(kinds_table(groups, time_groups(groups, rounds)), flush=True)


def print_pairs(name: str, variant: str, runner: ModelRunner, args: argparse.Namespace) -> None:
    """Forwards of a few rows after the benchmark's prompt with pairs from each of
    --pair-rows (bench/lowbit_rows.py)."""
    if kernel_isa() != "avx512vnni":
        print(f"[{name} {variant}] --pair-rows: the kernels run AVX2 here, which has no pairs")
        return
    prompt = bench_prompt(runner, args.prompt_len)
    runner.memory.free(0)
    runner.prefill(0, prompt)
    base = runner.memory.length(0)

    def forward(m: int) -> None:
        runner.memory.commit(0, base)
        _timed(runner, lambda: runner.forward([SlotInput(0, prompt[:m], m)]))

    samples = time_pairs(forward, args.pair_rows, args.repeats, ROWS)
    times = {case: statistics.median(seconds) for case, seconds in samples.items()}
    print(f"[{name} {variant}] forwards by where pairs start:", flush=True)
    print(pairs_table(times, args.pair_rows), flush=True)


def peak_mib() -> float:
    """This process's peak RSS since the last reset_peak_rss (load and measurement)."""
    return read_rss_mib("self", "VmHWM")


def _gguf(name: str) -> Path:
    from specserve.loading.sources import resolve_model

    path = resolve_model(name)
    if path.suffix != ".gguf":
        raise SpecserveError(f"--llama-bench needs a GGUF model; {name} is {path}")
    return path


def _llama_cpp_row(name: str, args: argparse.Namespace) -> dict:
    from specserve.bench.llama_cpp import llama_bench_row

    path = _gguf(name)
    row = llama_bench_row(
        args.llama_bench, path, args.threads, args.prompt_len, args.decode_len, args.repeats, KS
    )
    return {"model": name, "dtype": "llama.cpp", **row}


def _paired_row(name: str, variant: str, runner: ModelRunner, args: argparse.Namespace) -> dict:
    """Decode tok/s of ours and of llama.cpp, one pass each per round, back to back: the
    separate rows are minutes apart, and the memory speed of a shared VM moves in that time
    (figures: docs/perf/bench.md), so their ratio says as much about the minute as about the
    code. The slot still holds the benchmark's prompt (measure ran on it); each pass starts
    from its end."""
    from specserve.bench.llama_cpp import llama_decode_tok_s

    path, n = _gguf(name), args.decode_len
    last = bench_prompt(runner, args.prompt_len)[-1]
    ours: list[float] = []
    theirs: list[float] = []
    for r in range(args.paired_rounds):
        for side in (0, 1) if r % 2 == 0 else (1, 0):  # who goes first alternates
            if side == 0:
                ours.append(n / decode_pass(runner, args.prompt_len, last, n))
            else:
                theirs.append(
                    llama_decode_tok_s(args.llama_bench, path, args.threads, args.prompt_len, n)
                )
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {
        "model": name,
        "dtype": f"{variant} vs llama.cpp",
        "rounds": args.paired_rounds,
        "decode_tok_s": statistics.median(ours),
        "llama_cpp_decode_tok_s": statistics.median(theirs),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def print_paired(row: dict) -> None:
    print(
        f"{row['model']} paired decode, {row['rounds']} rounds: {row['dtype'].split()[0]} "
        f"{row['decode_tok_s']:.2f} tok/s, llama.cpp {row['llama_cpp_decode_tok_s']:.2f} "
        f"(medians); ours / llama.cpp per round: median {row['ratio']:.2f}, "
        f"range {row['ratio_min']:.2f}-{row['ratio_max']:.2f}",
        flush=True,
    )


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
        cells = [
            f"{r[c]:>20}" if i < 2 else f"{'-' if r[c] is None else format(r[c], '.2f'):>13}"
            for i, c in enumerate(cols)
        ]
        print(" | ".join(cells), flush=True)
