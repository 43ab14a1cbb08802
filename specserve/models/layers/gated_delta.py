"""The Gated DeltaNet layer of Qwen3-Next / Qwen3.5 (their "linear attention").

    qkv -> causal depthwise conv (kernel W, SiLU) -> q, k, v;  beta = sigmoid(b);
    g = -exp(A_log) * softplus(a + dt_bias);  o = gated delta rule (l2-normalised q, k);
    y = out(RMSNorm(o) * w * silu(z))

The state lives in a RecurrentCache, read at the start of a forward and written at the end
(explicit in/out, as the ops take it): nothing is hidden in the module. Sequences of a flat
batch differ in length and state, so the recurrent part runs per group of sequences with
the same length (no padding: a sequence's result does not depend on its batch-mates).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from specserve.batch import FlatBatch
from specserve.cache.recurrent import RecurrentCache
from specserve.models.config import HybridConfig
from specserve.ops.fast.gated_delta import gated_delta_rule
from specserve.ops.fast.short_conv import causal_conv1d
from specserve.ops.naive.gated_delta import compute_dtype


class GatedRMSNorm(nn.Module):
    """y = rms_norm(x) * w * silu(gate) over the last dim (transformers' RMSNormGated).

    Normalised in float32 (float64 for float64 inputs), scaled by w in the input dtype,
    gated in float32, as the reference does.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] -> [..., dim] in x's dtype."""
        wide = compute_dtype(x.dtype)
        h = x.to(wide)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.to(x.dtype) * h.to(x.dtype)
        return (h * F.silu(gate.to(wide))).to(x.dtype)


def length_groups(batch: FlatBatch) -> list[tuple[list[int], int, bool]]:
    """Sequences of the batch grouped by (length, keeps states): [(sequence ids, L, keep)].

    Sequences of one group stack into [B, L, ...] without padding.
    """
    groups: dict[tuple[int, bool], list[int]] = defaultdict(list)
    for i, n in enumerate(batch.lens()):
        groups[(n, batch.keeps_states(i))].append(i)
    return [(seqs, n, keep) for (n, keep), seqs in groups.items()]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: HybridConfig, index: int) -> None:
        """index: which of the model's Gated DeltaNet layers this is (its recurrent state)."""
        super().__init__()
        self.index = index
        hidden, heads = cfg.hidden_size, cfg.linear_num_value_heads
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.key_dim, cfg.value_dim
        self.qkv = nn.Linear(hidden, cfg.conv_dim, bias=False)  # rows: q | k | v, head-major
        self.z = nn.Linear(hidden, cfg.value_dim, bias=False)
        self.b = nn.Linear(hidden, heads, bias=False)
        self.a = nn.Linear(hidden, heads, bias=False)
        self.conv = nn.Parameter(torch.zeros(cfg.conv_dim, cfg.conv_kernel))  # [C, W]
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps)
        self.out = nn.Linear(cfg.value_dim, hidden, bias=False)

    def decay(self, a: torch.Tensor) -> torch.Tensor:
        """a: [T, HV] -> log decay g = -exp(A_log) * softplus(a + dt_bias) in float32+."""
        wide = compute_dtype(a.dtype)
        return -self.A_log.to(wide).exp() * F.softplus(a.to(wide) + self.dt_bias.to(wide))

    def forward(self, x: torch.Tensor, batch: FlatBatch, cache: RecurrentCache) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; the batch's slots' states advance in the cache."""
        T = x.shape[0]
        qkv = self.qkv(x)
        beta, g = self.b(x).sigmoid(), self.decay(self.a(x))
        o = x.new_empty(T, self.num_v_heads, self.v_dim)
        cu = batch.cu_seqlens
        for seqs, n, keep in length_groups(batch):
            rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs]).to(x.device)
            slots = torch.tensor([batch.slots[i] for i in seqs], device=x.device)
            o[rows] = self._mix(qkv[rows], g[rows], beta[rows], len(seqs), n, slots, keep, cache)
        z = self.z(x).view(T, self.num_v_heads, self.v_dim)
        return self.out(self.norm(o, z).reshape(T, self.value_dim))

    def _mix(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        n_seqs: int,
        n: int,
        slots: torch.Tensor,
        keep: bool,
        cache: RecurrentCache,
    ) -> torch.Tensor:
        """Conv + delta rule for B = n_seqs sequences of n tokens each, from their states.

        qkv: [B*n, C]; g, beta: [B*n, HV]; slots: [B] -> o [B*n, HV, V]. Writes the final
        states (and with `keep`, the state after every token) back to the cache.
        """
        conv_state, ssm_state = cache.read(self.index, slots)
        y, conv_final, conv_states = causal_conv1d(
            qkv.view(n_seqs, n, -1), self.conv, None, conv_state, "silu", output_all_states=keep
        )
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        res = gated_delta_rule(
            q.reshape(n_seqs, n, self.num_k_heads, self.k_dim),
            k.reshape(n_seqs, n, self.num_k_heads, self.k_dim),
            v.reshape(n_seqs, n, self.num_v_heads, self.v_dim),
            g.view(n_seqs, n, -1),
            beta.view(n_seqs, n, -1),
            initial_state=ssm_state,
            output_final_state=True,
            use_qk_l2norm=True,
            output_all_states=keep,
        )
        assert res.final_state is not None
        cache.write(self.index, slots, conv_final, res.final_state)
        if keep:
            assert conv_states is not None and res.states is not None
            cache.write_snapshots(self.index, slots, conv_states, res.states)
        return res.o.reshape(n_seqs * n, self.num_v_heads, self.v_dim)
