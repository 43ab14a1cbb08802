"""llama.cpp's `llama-bench` on the same GGUF file, as one more row of `bench decode`.

    specserve bench decode --llama-bench /path/to/llama-bench --variants float32+auto

Speed targets are only meaningful against llama.cpp measured on the same machine at the
same moment (a shared VM drifts within minutes: docs/perf/bench.md), so the comparison runs
inside our benchmark instead of quoting figures from elsewhere. The row's columns mean what
ours do:
- prefill: a prompt of `--prompt-len` tokens from an empty context;
- decode: `--decode-len` tokens after `--prompt-len` tokens of context (llama-bench -d);
- k=N: the time of one forward over N new tokens after that context, over N=1's.
Every figure is the median of llama-bench's repetitions; peak RSS is the child's own.

llama-bench is not shipped by any package; README.md says how to build it from the
llama-cpp-python source distribution on PyPI.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specserve.bench.server_process import read_rss_mib
from specserve.errors import SpecserveError


def run_llama_bench(exe: Path, args: Sequence[str]) -> tuple[list[dict[str, Any]], float]:
    """llama-bench's JSON results and its peak RSS in MiB.

    The peak is VmHWM from /proc, read every 0.1 s while the child runs: the rusage figure
    from wait4 starts at the parent's own peak (Linux carries it across fork), which for a
    benchmark holding a model already is larger than llama-bench's."""
    cmd = [str(exe), *args, "-o", "json"]
    peak = 0.0
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        except OSError as e:
            raise SpecserveError(f"cannot run llama-bench ({exe}): {e}") from e
        while proc.poll() is None:
            peak = max(peak, _hwm_mib(proc.pid))
            time.sleep(0.1)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        tail = stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise SpecserveError(f"llama-bench failed ({' '.join(cmd)}): {' / '.join(tail)}")
    return json.loads(stdout), peak


def _hwm_mib(pid: int) -> float:
    """A running process's peak resident memory (0 once it has gone)."""
    try:
        return read_rss_mib(pid, "VmHWM")
    except (OSError, SpecserveError):
        return 0.0


def median_seconds(result: dict[str, Any]) -> float:
    """One llama-bench test's median time in seconds."""
    return statistics.median(result["samples_ns"]) / 1e9


def row_from_results(results: list[dict[str, Any]], ks: Sequence[int]) -> dict[str, float]:
    """Our columns from llama-bench's tests: the prefill test (the largest prompt at depth 0),
    the generation test, and one prompt test per k at the decode depth."""
    prefill = max(
        (r for r in results if r["n_gen"] == 0 and r["n_depth"] == 0), key=lambda r: r["n_prompt"]
    )
    gen = next(r for r in results if r["n_gen"] > 0)
    at_depth = {
        r["n_prompt"]: median_seconds(r) for r in results if r["n_depth"] > 0 and r["n_gen"] == 0
    }
    missing = [k for k in ks if k not in at_depth]
    if missing:
        raise SpecserveError(f"llama-bench gave no prompt test for k = {missing}")
    return {
        "prefill_tok_s": prefill["n_prompt"] / median_seconds(prefill),
        "decode_tok_s": gen["n_gen"] / median_seconds(gen),
        **{f"k={k}": at_depth[k] / at_depth[1] for k in ks},
        "ms_k1": at_depth[1] * 1e3,
    }


def llama_bench_row(
    exe: Path,
    gguf: Path,
    threads: int,
    prompt_len: int,
    decode_len: int,
    repeats: int,
    ks: Sequence[int],
) -> dict[str, float]:
    """`bench decode`'s columns for llama.cpp on `gguf`."""
    common = ["-m", str(gguf), "-r", str(repeats)]
    if threads:
        common += ["-t", str(threads)]
    prefill, rss1 = run_llama_bench(exe, [*common, "-p", str(prompt_len), "-n", "0"])
    ks_arg = ",".join(str(k) for k in ks)
    rest, rss2 = run_llama_bench(
        exe, [*common, "-p", ks_arg, "-n", str(decode_len), "-d", str(prompt_len)]
    )
    row = row_from_results([*prefill, *rest], ks)
    row["peak_rss_mb"] = max(rss1, rss2)
    return row


def llama_decode_tok_s(exe: Path, gguf: Path, threads: int, depth: int, n: int) -> float:
    """llama.cpp's decode speed from one repetition: n tokens after `depth` tokens of context
    (one side of a round of `bench decode --paired-rounds`)."""
    args = ["-m", str(gguf), "-r", "1", "-p", "0", "-n", str(n), "-d", str(depth)]
    if threads:
        args += ["-t", str(threads)]
    results, _ = run_llama_bench(exe, args)
    gen = next((r for r in results if r["n_gen"] > 0), None)
    if gen is None:
        raise SpecserveError("llama-bench gave no generation test")
    return float(gen["n_gen"] / median_seconds(gen))
