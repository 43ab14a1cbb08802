"""Time the gated delta rule's step form against its chunked form, per call length T.

    python -m specserve.bench.gated_delta_ops [--heads 16] [--dim 128] [--repeats 20]
        [--threads N]

Sizes default to a Qwen3.5-0.8B Gated DeltaNet layer (16 heads, K = V = 128, one
sequence, q/k l2-normalized). Each cell is the best wall time of one call over --repeats,
in milliseconds (other load on a shared machine only ever adds time, so the minimum is
the most repeatable figure); "+states" also writes the state after every token (the
speculative-decoding snapshots). The last column is the form `gated_delta_rule(mode=
"auto")` picks without / with snapshots. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from specserve.ops.fast.gated_delta import (
    auto_max_recurrent,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

LENGTHS = (1, 2, 4, 8, 16, 32, 64)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(
    seq_len: int, heads: int, dim: int, dtype: torch.dtype, seed: int = 0
) -> dict[str, Any]:
    """Random q, k, v, g, beta and an initial state shaped like one GDN layer's call."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, seq_len, heads, dim)

    def rand(*size: int) -> torch.Tensor:
        return torch.rand(size, generator=gen)

    return {
        "q": torch.randn(shape, generator=gen).to(dtype),
        "k": torch.randn(shape, generator=gen).to(dtype),
        "v": torch.randn(shape, generator=gen).to(dtype),
        "g": -rand(1, seq_len, heads),  # log decay: model computes it in float32
        "beta": rand(1, seq_len, heads).to(dtype),
        "initial_state": torch.randn(1, heads, dim, dim, generator=gen),
    }


def best_ms(call: Callable[[], object], repeats: int) -> float:
    """Shortest wall time of `call` in ms, after two warm-up calls."""
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def run(heads: int, dim: int, repeats: int) -> list[str]:
    """One markdown table row per (dtype, T)."""
    forms = {"recurrent": recurrent_gated_delta_rule, "chunk": chunk_gated_delta_rule}
    rows = []
    for dtype_name, dtype in DTYPES.items():
        for seq_len in LENGTHS:
            inputs = make_inputs(seq_len, heads, dim, dtype)
            cells = []
            for all_states in (False, True):
                for form in forms.values():
                    call = partial(form, **inputs, use_qk_l2norm=True, output_all_states=all_states)
                    cells.append(f"{best_ms(call, repeats):.3f}")
            auto = "/".join(
                "recurrent" if seq_len <= auto_max_recurrent(states) else "chunk"
                for states in (False, True)
            )
            rows.append(f"| {dtype_name} | {seq_len} | " + " | ".join(cells) + f" | {auto} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128, help="K = V head dim")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"gated delta rule, B=1 H={args.heads} K=V={args.dim}, "
        f"{torch.get_num_threads()} threads, best ms per call"
    )
    print(
        "| dtype | T | recurrent | chunk | recurrent+states | chunk+states "
        "| auto (plain/states) |\n|---|---|---|---|---|---|---|"
    )
    for row in run(args.heads, args.dim, args.repeats):
        print(row)


if __name__ == "__main__":
    main()
