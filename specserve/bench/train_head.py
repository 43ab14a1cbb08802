"""`specserve train-head --model M`: an EAGLE-3 head for any served model, on this machine.

Text the machine has offline (bench/head_data.py): the model's own greedy answers to prompts
made here (self-distillation: the head learns what this model says) and/or the Python
standard library's source. Each sequence costs one target forward (taps and labels); the head trains
on it with EAGLE-3's training-time test (speculative/head_training.py) until the budget is
spent, checkpointing as it goes (a second run resumes). Answers held out by their prompt's
hash give the acceptance curve at the end and the head's calibration (how often each class
of its confidence was kept, which a server starts its rates from); the head is saved in
SpecForge's public layout, the calibration beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch

from specserve.bench.args import numbers
from specserve.bench.head_data import (
    HELD_OUT,
    STDLIB_TOKENS,
    cached_answers,
    pieces,
    split_answers,
    stdlib_chunks,
    write_whole,
)
from specserve.bench.row_cache import ROW_CACHE_RESERVE, RowCache
from specserve.engine.request import SpecParams
from specserve.errors import SpecserveError
from specserve.loading.eagle3 import own_head_dir, save_calibration, save_eagle3
from specserve.loading.model import LoadedModel, load_model
from specserve.models.eagle3 import HeadCalibration, default_aux_layers, taps_fit
from specserve.models.registry import LanguageModel
from specserve.speculative import head_training as ht
from specserve.speculative.mtp import CONFIDENCE
from specserve.trim import keep_freed_memory

EVAL_DEPTH = 4  # draft positions scored, however deep the training unrolled
LR = 6e-4
# a resumed run peaks at this share of LR: restarted at the full rate, a 25-minute resume of
# a 100-minute head undid more than it added (docs/perf/2026-11-29-fresh-head.md)
RESUME_LR = 0.25


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the target (name, .gguf or HF folder)")
    p.add_argument("--out", default=None, help="where the head goes (default: the cache's heads/)")
    p.add_argument(
        "--minutes",
        type=float,
        default=120.0,
        help="time budget, all included; 0 with a head already in --out measures it again "
        "(acceptance and calibration) without training",
    )
    p.add_argument(
        "--data",
        default="answers,stdlib",
        help="answers (the model's own) and/or stdlib (the Python standard library's source, "
        "which taught the head the Python code its answers alone did not), comma-separated "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--stdlib-tokens",
        type=int,
        default=STDLIB_TOKENS,
        help="tokens of the standard library's source to train on, its modules in a seeded "
        "random order (default: %(default)s)",
    )
    p.add_argument(
        "--answers",
        type=int,
        default=900,
        help="self-distilled answers to make (the held-out set is cut from them)",
    )
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=256,
        help="tokens per answer at most (an answer ends at the model's end of turn)",
    )
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument(
        "--steps",
        type=int,
        default=2,
        help="training-time-test depth: draft positions trained (1: the first alone, which "
        "leaves a second draft position untrained)",
    )
    p.add_argument(
        "--step-weights",
        default=None,
        help="each unrolled step's loss weight, e.g. 1,0.3 with --steps 2, the first step "
        "weighing most (default: alike)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=16000,
        help="draft vocabulary size (its LM head is most of a step's cost)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"peak learning rate (default {LR:g}; a resumed run {LR * RESUME_LR:g})",
    )
    p.add_argument(
        "--norm-before-residual",
        action="store_true",
        help="the head's residual starts from its normed input state, as RedHat's heads",
    )
    p.add_argument(
        "--soft-top",
        type=int,
        default=32,
        help="learn the target's distribution over its k likeliest tokens (0: its argmax)",
    )
    p.add_argument(
        "--feature-weight",
        type=float,
        default=0.0,
        help="weight of the feature loss: step 0's output state pulled toward the target's "
        "fused state one position on, which step 1 reads in its place (0: off)",
    )
    p.add_argument(
        "--taps",
        default=None,
        help="the three target layers the head reads, as vLLM counts them (a layer's input; "
        "0 = the embedding), comma-separated (default: vLLM's low, middle, high)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--row-cache-gb",
        type=float,
        default=6.0,
        help="RAM for the target's rows of sequences seen, reused when the data repeats "
        f"(rows are kept only while {ROW_CACHE_RESERVE // 2**30} GiB of RAM stays free)",
    )
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many (0: budget)")


def draft_vocab(target: LanguageModel, seqs: list[list[int]], size: int) -> torch.Tensor:
    """The target ids the model says most often on this text (its argmax after each prefix
    stands in for what it would say), sorted."""
    counts: Counter[int] = Counter()
    for s in seqs:
        counts.update(s)
    common = [t for t, _ in counts.most_common(size)]
    chosen = set(common)
    rest = [t for t in range(target.cfg.vocab_size) if t not in chosen]
    return torch.tensor(sorted(common + rest[: size - len(common)]))


def taps(spec: str | None, num_layers: int) -> tuple[int, ...]:
    """`--taps`: three layer ids of the target (vLLM's count), or vLLM's default."""
    if not spec:
        return default_aux_layers(num_layers)
    ids = tuple(numbers(spec, int))
    if not taps_fit(ids, num_layers):
        raise SpecserveError(f"--taps: three layer ids in 0..{num_layers - 1}, got {spec!r}")
    return ids


def _checkpoint(
    path: Path, head: ht.Eagle3Head, opt: torch.optim.Optimizer, step: int, tokens: int
) -> None:
    state = {"step": step, "tokens": tokens, "d2t": head.d2t.clone(), "taps": head.cfg.aux_layers}
    full = {"head": head.state_dict(), "opt": opt.state_dict(), **state}
    write_whole(path, lambda tmp: torch.save(full, tmp))


def evaluate(
    head: ht.Eagle3Head, target: LanguageModel, rows: list[ht.TargetRows], steps: int
) -> tuple[dict, HeadCalibration]:
    """Held-out acceptance: top-1 at the first draft position, per position the chance that
    a draft reaching it is kept there, and each unrolled step's own top-1 whatever the steps
    before it drafted (rows before each row's `start` not scored); and the head's
    calibration, as a server drafts (CONFIDENCE classes, the default p_min)."""
    kept, reached, alone, repeats = [0] * steps, [0] * steps, [0] * steps, [0] * steps
    p_min = SpecParams().p_min
    cal = HeadCalibration.empty(CONFIDENCE, p_min)
    with torch.no_grad():
        for r in rows:
            scored = ht.unrolled_logits(head, target.embed, r, steps)
            pairs = [(lg[r.start :], lb[r.start :]) for lg, lb in scored]
            cal += ht.confidence_counts(head, pairs, CONFIDENCE, p_min)
            k, n = ht.acceptance_counts(head, pairs)
            drafted = [lg.argmax(dim=-1)[: n[0]] for lg, _ in pairs]
            for j, (_, lb) in enumerate(pairs):
                kept[j], reached[j] = kept[j] + k[j], reached[j] + n[j]
                alone[j] += int((head.d2t[drafted[j]] == lb[: n[0]]).sum())
                if j > 0:  # how often step j only says step j - 1's token again
                    repeats[j] += int((drafted[j] == drafted[j - 1]).sum())
    curve = [k / n if n else 0.0 for k, n in zip(kept, reached, strict=True)]
    total = max(reached[0], 1)
    step_top1 = [a / total for a in alone]
    step_repeats = [a / total for a in repeats[1:]]
    report = {
        "top1": curve[0],
        "per_position": curve,
        "step_top1": step_top1,
        "step_repeats": step_repeats,
        "rows": reached[0],
        # kept share of the first token per class, and of later ones past p_min
        "first_by_class": [
            k / n if n else None for k, n in zip(cal.first_kept, cal.first_rows, strict=True)
        ],
        "later_kept": cal.later_kept / cal.later_rows if cal.later_rows else None,
    }
    return report, cal


def weights_of_steps(spec: str | None, steps: int) -> list[float] | None:
    """--step-weights "1,0.3" -> [1.0, 0.3], one per unrolled step (None: steps alike)."""
    if spec is None:
        return None
    weights = numbers(spec, float)
    if len(weights) != steps or min(weights) < 0 or not any(weights):
        raise SpecserveError(
            f"--step-weights: {steps} comma-separated weights >= 0 (one per --steps), "
            f"not all 0; got {spec!r}"
        )
    return weights


def peak_lr(lr: float | None, resumed: bool) -> float:
    """The run's peak learning rate: `--lr` where given, else LR, lowered for a resume."""
    if lr is not None:
        return lr
    return LR * RESUME_LR if resumed else LR


def lr_scale(step: int, done: float, warmup: int = 50) -> float:
    """Linear warmup, then a cosine from 1 to 0.1 as the budget (`done`, 0..1) is spent."""
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


def train(
    loaded: LoadedModel,
    seqs: list[list[int]],
    out: Path,
    args: argparse.Namespace,
    deadline: float,
    held: list[tuple[list[int], int]] | None = None,
) -> dict:
    """Train (or resume) a head on seqs until the deadline; save it; return the report.
    held: (tokens, first scored row) to measure on; by default a tenth of seqs."""
    from tqdm import tqdm

    target = loaded.model
    random.Random(args.seed).shuffle(seqs)
    if held is None:
        cut = max(1, min(len(seqs) // 10, HELD_OUT))
        held, seqs = [(s, 0) for s in seqs[:cut]], seqs[cut:]
    ckpt = out / "checkpoint.pt"
    size = min(args.draft_vocab, target.cfg.vocab_size)
    saved = torch.load(ckpt, weights_only=False) if ckpt.exists() else None
    # a resumed head keeps the layers it was started on
    layers = tuple(saved["taps"]) if saved else taps(args.taps, target.cfg.num_layers)
    ids = saved["d2t"] if saved else draft_vocab(target, seqs, size)
    head = ht.new_head(target, ids, args.norm_before_residual, layers)
    # fused: one pass over all parameters rather than a loop of small ops per tensor
    peak = peak_lr(args.lr, saved is not None)
    opt = torch.optim.AdamW(head.parameters(), lr=peak, weight_decay=0.0, fused=True)
    if saved:
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["opt"])
    step, tokens = (saved["step"], saved["tokens"]) if saved else (0, 0)
    start = step  # a resumed run's learning rate follows its own budget, from warm again
    top_lr = 0.0
    t2d = torch.full((target.cfg.vocab_size,), -1, dtype=torch.long)
    t2d[head.d2t] = torch.arange(len(head.d2t))
    warmup = max(1, min(50, args.max_steps // 10)) if args.max_steps else 50
    seen = RowCache(int(args.row_cache_gb * 2**30))
    step_weights = weights_of_steps(args.step_weights, args.steps)

    def label(i: int) -> ht.TargetRows:
        return ht.target_rows(target, seqs[i], layers, top=args.soft_top)

    t0 = last_save = time.monotonic()
    losses: list[float] = []
    with tqdm(desc="train-head", unit="seq", initial=step) as bar:
        while time.monotonic() < deadline and seqs and not _enough(step, args.max_steps):
            done = _done(step - start, args.max_steps - start, t0, deadline)
            lr = peak * lr_scale(step - start, done, warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            top_lr = max(top_lr, lr)
            rows = seen.get(step % len(seqs), label)
            u = ht.unrolled(head, target.embed, rows, args.steps)
            loss = ht.ttt_loss(head, t2d, u.pairs, rows, step_weights)
            feature = ht.feature_loss(u) if args.feature_weight > 0 else None
            if feature is not None:
                loss = loss + args.feature_weight * feature
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step, tokens = step + 1, tokens + len(rows.tokens)
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if time.monotonic() - last_save > 120:
                _checkpoint(ckpt, head, opt, step, tokens)
                last_save = time.monotonic()
    _checkpoint(ckpt, head, opt, step, tokens)
    test_rows = [ht.target_rows(target, s, layers, start) for s, start in held]
    depth = max(args.steps, EVAL_DEPTH)
    measured, cal = evaluate(head, target, test_rows, depth)
    report_file = out / "train_report.json"
    # a resumed run keeps what its report said before (the loss of a run that trained)
    before = json.loads(report_file.read_text()) if saved and report_file.exists() else {}
    report = {**before, "steps": step, "tokens": tokens, **measured}
    if top_lr > 0:
        report["lr_peak"] = top_lr
    if len(losses) >= 20:  # this run's first and last ten steps
        report["loss_first"], report["loss_last"] = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    save_eagle3(head, out)
    save_calibration(cal, out)
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _done(step: int, max_steps: int, t0: float, deadline: float) -> float:
    """How much of this run's budget is spent, 0..1: steps when capped, else time."""
    if max_steps > 0:
        return step / max_steps
    return (time.monotonic() - t0) / max(deadline - t0, 1e-9)


def _enough(step: int, max_steps: int) -> bool:
    """Whether `--max-steps` is reached (0: no step limit, only the time budget)."""
    return 0 < max_steps <= step


def train_own_head(model: str, minutes: float) -> None:
    """`specserve train-head --model MODEL --minutes MINUTES` with the other flags' defaults:
    the head a server's default chain and the benchmarks take in, into the cache."""
    p = argparse.ArgumentParser()
    add_args(p)
    main(p.parse_args(["--model", model, "--minutes", str(minutes)]))


def main(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    torch.manual_seed(args.seed)
    # the weights a server loads by default: the labels are what the served model says
    loaded = load_model(args.model, "float32", progress=True, weights="auto")
    # only now: the load's temporaries are trimmed away, which a kept heap would hold
    keep_freed_memory()
    out = Path(args.out) if args.out else own_head_dir(args.model)
    out.mkdir(parents=True, exist_ok=True)
    kinds = {k.strip() for k in args.data.split(",") if k.strip()}
    if not kinds or kinds - {"answers", "stdlib"}:
        raise SpecserveError(f"--data: answers and/or stdlib, got {args.data!r}")
    seqs: list[list[int]] = []
    held: list[tuple[list[int], int]] | None = None
    if "answers" in kinds:
        own = cached_answers(loaded, args.model, args.answers, args.answer_tokens, args.seed)
        kept_out, trained = split_answers(own)
        # whole answers are held out, scored from their reply's first draft on
        held = [(p + r, max(0, len(p) - 2)) for p, r in kept_out]
        seqs += pieces([p + r for p, r in trained], args.seq_len)
    if "stdlib" in kinds:
        seqs += stdlib_chunks(loaded, args.stdlib_tokens, args.seq_len, args.seed)
    print(f"data: {len(seqs)} sequences in {time.monotonic() - t0:.0f}s")
    report = train(loaded, seqs, out, args, deadline, held)
    report["minutes"] = (time.monotonic() - t0) / 60
    print(json.dumps(report))
    print(f"head saved in {out}")
