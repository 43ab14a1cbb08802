"""Sparse mixture of experts with a gated shared expert (Qwen3-Next's MLP).

    weights, experts = top_k(softmax(router(x)))     (renormalised over the k when asked)
    y = sum_k weights_k * expert_k(x) + sigmoid(shared_gate(x)) * shared(x)

Each expert is a SwiGLU MLP; their weights are stacked: gate_exps, up_exps [E, I, D] and
down_exps [E, D, I] (llama.cpp's layout, and transformers' once split). Tokens are
dispatched expert by expert in ascending order, so a token's sum does not depend on which
other tokens share the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.layers.basic import GatedMLP
from specserve.ops.naive.gated_delta import compute_dtype


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        inner: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        shared_inner: int,
    ) -> None:
        """shared_inner: the shared expert's intermediate size (0 = no shared expert)."""
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.gate_exps = nn.Parameter(torch.zeros(num_experts, inner, hidden))
        self.up_exps = nn.Parameter(torch.zeros(num_experts, inner, hidden))
        self.down_exps = nn.Parameter(torch.zeros(num_experts, hidden, inner))
        self.shared = GatedMLP(hidden, shared_inner, "silu") if shared_inner else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared_inner else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] in x's dtype, expert ids [T, k]).

        The softmax runs in float32 (float64 for float64 inputs), as transformers does."""
        probs = F.softmax(self.router(x), dim=-1, dtype=compute_dtype(x.dtype))
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            tokens, pick = torch.where(experts == e)
            h = x[tokens]
            h = F.silu(F.linear(h, self.gate_exps[e])) * F.linear(h, self.up_exps[e])
            h = F.linear(h, self.down_exps[e]) * weights[tokens, pick, None]
            out.index_add_(0, tokens, h)
        if self.shared is not None and self.shared_gate is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out
