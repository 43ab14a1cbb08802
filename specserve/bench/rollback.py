"""Benchmark: what rolling recurrent state back costs per verification step.

    specserve bench rollback [--draft-len 4] [--steps 12] [--dtype bfloat16] [--weights int8]

A random model shaped like Qwen3.5-0.8B (24 layers, 18 Gated DeltaNet + 6 gated attention,
hidden 1024, vocab 248320) verifies drafts on one slot. The drafts are the model's own
greedy continuation (decoded once up front) with an error injected at a chosen position,
so each step keeps exactly the number of tokens the acceptance level asks for: 0, 25, 50,
75 or 100 percent of the draft. Per strategy (snapshots, checkpoint + replay, auto) the
table shows the time of a verification step (the verify forward plus the commit, replay
included) and the memory each strategy's rollback buffers take.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.engine.runner import ModelRunner, SlotInput
from specserve.loading.model import linear_modes, parse_dtype
from specserve.models.config import HybridConfig
from specserve.models.layers.quant import swap_linears
from specserve.models.qwen3_next import HybridTransformer

STRATEGIES = ("snapshots", "checkpoint", "auto")
ACCEPTANCE = (0.0, 0.25, 0.5, 0.75, 1.0)


def qwen35_08b_config(vocab_size: int = 248320) -> HybridConfig:
    """Qwen3.5-0.8B's text shapes (its config.json), with random weights to come."""
    return HybridConfig(
        arch="qwen3_5",
        vocab_size=vocab_size,
        hidden_size=1024,
        intermediate_size=3584,
        num_layers=24,
        num_heads=8,
        num_kv_heads=2,
        head_dim=256,
        context_length=262144,
        rope_theta=1e7,
        qk_norm=True,
        tie_word_embeddings=True,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        conv_kernel=4,
    )


def random_model(cfg: HybridConfig, dtype: torch.dtype, seed: int = 0) -> HybridTransformer:
    """Random weights in trained-like ranges (norms 1, decays A in [1, 16])."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = HybridTransformer(cfg)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.uniform_(1.0, 16.0).log_()
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.tie_weights()
    for name, p in model.named_parameters():
        if not name.endswith(("norm.weight", "A_log", "dt_bias")):
            p.data = p.data.to(dtype)  # norms and decay terms stay float32, as when loaded
    return model.eval()


@dataclass
class Step:
    """One verification: feed [last, d1..dk]; the target keeps `kept` of them."""

    tokens: list[int]
    kept: int


def scripted_steps(
    reference: list[int], k: int, accepted: int, n_steps: int, vocab: int
) -> list[Step]:
    """Drafts from the known greedy continuation, wrong from position `accepted` on; the
    step after keeps last + accepted drafts and continues with the target's own token."""
    steps, pos = [], 0
    for _ in range(n_steps):
        draft = reference[pos + 1 : pos + 1 + k]
        if accepted < k:
            draft[accepted] = (draft[accepted] + 1) % vocab  # the injected error
        steps.append(Step([reference[pos], *draft], accepted + 1))
        pos += accepted + 1  # the target's correction / bonus token is reference[pos]
    return steps


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding on slot 0 (then freed): prompt[-1] + n generated tokens."""
    runner.prefill(0, prompt[:-1])
    out = [prompt[-1]]
    for _ in range(n):
        (logits,) = runner.forward([SlotInput(0, [out[-1]])])
        out.append(int(logits[-1].argmax()))
    runner.free(0)
    return out


def timed_step(runner: ModelRunner, step: Step) -> float:
    """Seconds of one verification on slot 0: the verify forward, then the commit."""
    start = runner.memory.length(0)
    t0 = time.perf_counter()
    runner.forward([SlotInput(0, step.tokens, len(step.tokens), verify=True)])
    runner.commit({0: start + step.kept})
    runner.sync()
    return time.perf_counter() - t0


def measure(
    runners: dict[str, ModelRunner], prompt: list[int], steps: list[Step], warmup: int
) -> dict[str, float]:
    """Median seconds per verification step for each strategy. The strategies take turns
    step by step (each on its own runner), so load on the machine hits them alike."""
    for runner in runners.values():
        runner.free(0)
        runner.prefill(0, prompt[:-1])
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step in steps:
        for name, runner in runners.items():
            times[name].append(timed_step(runner, step))
    return {name: statistics.median(ts[warmup:]) for name, ts in times.items()}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-len", type=int, default=4, help="draft tokens per verification (4)")
    p.add_argument("--steps", type=int, default=8, help="timed verifications per cell (8)")
    p.add_argument(
        "--warmup", type=int, default=8, help="untimed verifications first (8: auto settles)"
    )
    p.add_argument("--prompt-len", type=int, default=64, help="tokens before verifying (64)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--weights",
        default="dequant",
        choices=["dequant", "int8", "int6", "int5", "int4"],
        help="dequant: weights in --dtype; int8 / int4: weight-only quantized linears, as "
        "`--weights` loads them (verify rows are cheap with them on AVX2)",
    )
    p.add_argument("--vocab", type=int, default=248320, help="vocabulary size (Qwen3.5's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared 2-core machine OpenMP's spinning "
        "makes small ops tens of times slower with 2; 0 = torch's default)",
    )
    p.add_argument("--json-out", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--plot", type=Path, default=None, help="also draw ms/step per strategy")


def main(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    k = args.draft_len
    n_steps = args.warmup + args.steps
    cfg = qwen35_08b_config(args.vocab)
    model = random_model(cfg, parse_dtype(args.dtype))
    swap_linears(model, linear_modes(model, args.weights, {}))
    model = model.to(args.device)
    ctx = args.prompt_len + (k + 1) * n_steps + 8
    prompt = torch.randint(0, args.vocab, (args.prompt_len,), generator=torch.Generator())
    plain = ModelRunner(model, 1, ctx, rollback="checkpoint")
    reference = greedy(plain, prompt.tolist(), (k + 1) * n_steps)
    prompt_ids = prompt.tolist()[:-1] + reference[:1]
    runners = {s: ModelRunner(model, 1, ctx, rollback=s, snapshot_depth=k + 1) for s in STRATEGIES}
    rows = []
    for acc in ACCEPTANCE:
        accepted = round(acc * k)
        auto = runners["auto"].policy
        auto.counts = dict.fromkeys(auto.counts, 0)
        steps = scripted_steps(reference, k, accepted, n_steps, args.vocab)
        ms = {s: t * 1e3 for s, t in measure(runners, prompt_ids, steps, args.warmup).items()}
        chose = auto.counts
        picks = chose["snapshots"] / max(1, chose["snapshots"] + chose["checkpoint"])
        rows.append({"acceptance": acc, "accepted": accepted, **ms, "auto_snapshot_share": picks})
        print_table(rows[-1:], header=len(rows) == 1, k=k)
    memory = rollback_memory(runners)
    print_memory(memory, k)
    if args.json_out:
        args.json_out.write_text(json.dumps({"rows": rows, "memory_bytes": memory}, indent=2))
    if args.plot:
        plot(rows, args.plot)


def rollback_memory(runners: dict[str, ModelRunner]) -> dict[str, dict[str, int]]:
    """Bytes of recurrent state per strategy: live, snapshot buffers, checkpoints."""
    out = {}
    for name, runner in runners.items():
        rec = runner.memory.recurrent
        assert rec is not None
        sizes = rec.nbytes()
        if name == "snapshots":
            sizes["checkpoints"] = 0  # allocated, never written under this strategy
        out[name] = sizes
    return out


def print_table(rows: list[dict], header: bool, k: int) -> None:
    if header:
        print(f"verification of {k} draft tokens + 1, ms per step (verify forward + commit)")
        cols = ("accept", "kept", "snapshots", "checkpoint", "auto", "ckpt/snap", "auto/best")
        print(" | ".join(f"{c:>10}" for c in cols) + " | auto picked snapshots")
    for r in rows:
        best = min(r["snapshots"], r["checkpoint"])
        cells = [
            f"{r['acceptance'] * 100:>9.0f}%",
            f"{r['accepted'] + 1:>4d} of {k + 1:<2d}",
            *(f"{r[s]:>10.1f}" for s in STRATEGIES),
            f"{r['checkpoint'] / r['snapshots']:>9.2f}x",
            f"{(r['auto'] / best - 1) * 100:>+9.1f}%",
        ]
        print(" | ".join(cells) + f" | {r['auto_snapshot_share'] * 100:.0f}% of steps", flush=True)


def print_memory(memory: dict[str, dict[str, int]], k: int) -> None:
    mib = 2.0**20
    live = memory["snapshots"]["live"] / mib
    print(f"recurrent state per slot: {live:.1f} MiB live (conv + SSM of every GDN layer)")
    for name, sizes in memory.items():
        extra = (sizes["snapshots"] + sizes["checkpoints"]) / mib
        print(
            f"  {name:>10}: +{extra:.1f} MiB for rollback "
            f"(snapshots {sizes['snapshots'] / mib:.1f} = {k + 1} positions, "
            f"checkpoint {sizes['checkpoints'] / mib:.1f})"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in STRATEGIES:
        ax.plot([r["acceptance"] * 100 for r in rows], [r[s] for r in rows], marker="o", label=s)
    ax.set_xlabel("draft tokens accepted (%)")
    ax.set_ylabel("ms per verification step")
    ax.set_title("Rolling back Gated DeltaNet state (Qwen3.5-0.8B shape)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
