"""Command-line flags that describe an engine, shared by `generate`, `serve` and benchmarks.

Flags become an EngineSettings (and per-request SpecParams defaults) here, nowhere else.
"""

from __future__ import annotations

import argparse

import torch

from specserve.engine.request import SpecParams
from specserve.engine.rollback import STRATEGIES
from specserve.engine.setup import EngineSettings
from specserve.loading.eagle3 import has_own_head
from specserve.models.layers.quant import WEIGHT_MODES
from specserve.speculative.registry import SPEC_TYPES, parse_types

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def add_engine_args(p: argparse.ArgumentParser, default_spec: str, slots: int) -> None:
    """Model, precision and speculation flags; `slots` > 1 adds -np/--parallel."""
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help=f"a model name (see `specserve models list`), a .gguf file or an HF folder "
        f"(default {DEFAULT_MODEL})",
    )
    m.add_argument(
        "--dtype",
        default="float32",
        choices=["float64", "float32", "bfloat16"],
        help="compute dtype; float weights are converted to it (default float32)",
    )
    m.add_argument(
        "--weights",
        default="auto",
        choices=WEIGHT_MODES,
        help="dequant: float weights; int8 / int6 / int5 / int4: weights kept quantized in "
        "blocks of 32 (float32 on CPU: specserve's AVX2 kernels, built on first use; bfloat16: "
        "torch's, int5 and int6 on its int8); auto (default): each GGUF tensor on the kernel "
        "nearest its own precision (Q4_x: int4, Q5_0: int5, Q6_K: int6, other 5-8 bit: int8), "
        "float tensors stay float",
    )
    m.add_argument(
        "--no-prepack",
        dest="prepack",
        action="store_false",
        help="float32 on CPU: run linears on torch's F.linear instead of oneDNN's weights "
        "packed once at load (packing makes a k-token forward far cheaper; on by default)",
    )
    m.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    m.add_argument(
        "--threads",
        "-t",
        type=int,
        default=0,
        help="CPU threads per forward; 0 (default): 1 or all cores, whichever this machine "
        "measures faster now (two threads lose to one when other work shares the cores)",
    )
    m.add_argument(
        "--ctx-size", "-c", type=int, default=0, help="context per slot (default min(model, 4096))"
    )
    m.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant kernels: a sequence's output never depends on what shares "
        "its batch (slower)",
    )
    m.add_argument(
        "--no-cache-prompt",
        dest="cache_prompt",
        action="store_false",
        help="prefill every prompt in full; by default a slot keeps its last request's "
        "tokens and a new request starts after the prefix it shares with them (a "
        "follow-up turn, a common system prompt); requests may opt out with cache_prompt",
    )
    m.add_argument(
        "--cache-ram",
        type=float,
        default=None,
        metavar="MB",
        help="MiB of host memory for the prompt store, which keeps the slots' states after "
        "their slots are reused and restores a returning conversation's (LRU); default: a "
        "quarter of available memory, at most 8 GiB; 0 turns it off",
    )
    if slots > 1:
        m.add_argument(
            "--parallel", "-np", type=int, default=slots, help=f"parallel slots (default {slots})"
        )
    _add_spec_args(p, default_spec)


def _add_spec_args(p: argparse.ArgumentParser, default_spec: str) -> None:
    d = SpecParams()
    s = p.add_argument_group("speculative decoding (greedy output is the same on or off)")
    s.add_argument(
        "--spec-type",
        default=None,
        help=f"comma-separated types or 'none': {', '.join(SPEC_TYPES)}; several make a "
        f"chain that picks the most promising draft per slot and step; `prediction` drafts "
        f"only from a server request's OpenAI `prediction` (default {default_spec}, and "
        f"eagle3 when the model has its own head in $SPECSERVE_CACHE/heads: train-head)",
    )
    p.set_defaults(spec_default=default_spec)
    s.add_argument(
        "--draft-model",
        "-md",
        default=None,
        help="draft model (name, .gguf, folder); with `eagle3` and no `draft`: the EAGLE-3 head",
    )
    s.add_argument(
        "--draft-head",
        default=None,
        help="EAGLE-3 head for `eagle3`: an HF folder, a .gguf or a name in "
        "$SPECSERVE_CACHE/heads (default: the model's own, <model>-eagle3, from train-head)",
    )
    s.add_argument(
        "--draft-weights",
        default="auto",
        choices=WEIGHT_MODES,
        help="--weights of the draft model and the EAGLE-3 head; auto (default): int4 on "
        "the CPU, whatever their files hold, and float weights where --weights auto keeps "
        "them (float64, GPU); a draft's precision moves how many of its tokens are kept, "
        "never the output, and int4 halves what a draft token reads from memory",
    )
    s.add_argument(
        "--draft-probs",
        action="store_true",
        help="eagle3: a sampled request (temperature > 0) gets drafts sampled from the head "
        "with their probabilities, verified by rejection sampling: more drafts kept, the same "
        "output distribution, but a seed no longer gives the text it gives without "
        "speculation (off: argmax drafts, seeded text the same on or off)",
    )
    s.add_argument("--draft-max", type=int, default=d.n_max, help=f"most draft tokens ({d.n_max})")
    s.add_argument(
        "--draft-min", type=int, default=d.n_min, help=f"drop shorter drafts ({d.n_min})"
    )
    s.add_argument(
        "--draft-p-min",
        type=float,
        default=d.p_min,
        help="a draft model stops before a token it gives less probability; a head "
        f"(eagle3, mtp) drafts its first token at any and learns which are kept ({d.p_min})",
    )
    s.add_argument(
        "--draft-alternatives",
        type=int,
        default=d.alternatives,
        help="a head (eagle3, mtp) offers this many runners-up for each draft token, each "
        "verified in one more row beside the draft where it is worth that row: a token tree "
        "whose side branches are one token long, for greedy requests without penalties or a "
        f"grammar on attention-only targets; 0: none ({d.alternatives})",
    )
    s.add_argument(
        "--rollback",
        default="auto",
        choices=STRATEGIES,
        help="hybrid (recurrent) models: snapshots = keep the state after every verified "
        "token, checkpoint = copy it before verifying and replay accepted tokens, auto = "
        "the cheaper per step by measured costs (default auto)",
    )
    s.add_argument(
        "--rollback-budget-mb",
        type=float,
        default=None,
        help="most MiB of snapshot buffers --rollback auto may use (default: no cap)",
    )


def spec_types_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--spec-type as given; by default the default chain, which takes in the model's own
    EAGLE-3 head once `train-head` has made one (its value model asks it where it pays)."""
    if args.spec_type is not None:
        return tuple(parse_types(args.spec_type))
    names = parse_types(args.spec_default)
    hidden = {"eagle3", "mtp"} & set(names)
    if names and not hidden and has_own_head(args.model):
        names.append("eagle3")
    return tuple(names)


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return EngineSettings(
        model=args.model,
        dtype=args.dtype,
        device=device,
        num_slots=getattr(args, "parallel", 1),
        ctx_size=args.ctx_size,
        spec_types=spec_types_from_args(args),
        draft_model=args.draft_model,
        draft_head=getattr(args, "draft_head", None),
        draft_probs=getattr(args, "draft_probs", False),
        weights=args.weights,
        draft_weights=getattr(args, "draft_weights", None),
        deterministic=args.deterministic,
        prepack=args.prepack,
        threads=args.threads,
        cache_prompt=args.cache_prompt,
        cache_ram_mb=args.cache_ram,
        rollback=args.rollback,
        snapshot_depth=args.draft_max + 1,  # n_rs_seq: every draft token plus the last one
        snapshot_budget_mb=args.rollback_budget_mb,
    )


def spec_defaults_from_args(args: argparse.Namespace) -> SpecParams:
    """Per-request speculation defaults (ValueError if the flags contradict each other)."""
    return SpecParams(
        args.draft_max, args.draft_min, args.draft_p_min, alternatives=args.draft_alternatives
    )
