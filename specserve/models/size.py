"""What a model costs to run, in bytes: decoding is memory-bound, so a drafter's step costs
about the share of the target's weight bytes that it reads."""

from __future__ import annotations

import torch


def step_bytes(module: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer (quantized layers
    keep their weights in integer buffers) but the embedding table, whose rows are looked up
    (an LM head tied to it counts: it is read whole), and int64 index tables (`d2t`)."""
    named = module.named_parameters(remove_duplicate=False)
    seen: dict[int, torch.Tensor] = {id(p): p for n, p in named if not n.startswith("embed.")}
    buffers = module.named_buffers()
    seen.update(
        {id(b): b for n, b in buffers if not n.startswith("embed.") and b.dtype != torch.int64}
    )
    return sum(p.numel() * p.element_size() for p in seen.values())
