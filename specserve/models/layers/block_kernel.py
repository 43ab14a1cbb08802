"""A dense decoder block as one C++ call (ops/cpu/block.cpp) where every piece of it runs on
our float32 CPU kernels: fused low-bit q/k/v and gate/up, low-bit o and down, float32
norms, the one-op attention. The module path makes ~15 Python calls around the same 8
kernels; the kernel block makes one, with the same kernels in the same order (the same bits:
tests/models/test_quant.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specserve.models.layers.basic import RMSNorm
from specserve.models.layers.lowbit import LowbitCall
from specserve.models.layers.lowbit_fused import fused_of
from specserve.ops.cpu.build import problem

if TYPE_CHECKING:
    from specserve.models.layers.attention import Attention
    from specserve.models.layers.basic import GatedMLP
    from specserve.models.llama import Block


def _norm_weight(norm: RMSNorm | None) -> torch.Tensor | None:
    """A norm's weight when the kernels can take it (float32 CPU, a multiple of 8 wide)."""
    if norm is None:
        return None
    w = norm.weight
    ok = w.dtype == torch.float32 and w.device.type == "cpu" and w.shape[-1] % 8 == 0
    return w.detach() if ok else None


def _call(kernels: Any, layer: nn.Module | None) -> Any | None:
    """A low-bit layer (fused or not) as the kernels' LinearCall."""
    if not isinstance(layer, LowbitCall):
        return None
    records, kinds, n_outs = layer.parts()
    bias = None if layer.bias is None else layer.bias.detach()
    return kernels.LinearCall(records, kinds, n_outs, bias)


def _norms_ok(pairs: list[tuple[RMSNorm | None, torch.Tensor | None]]) -> bool:
    """Every norm the block has is one the kernels take."""
    return all(w is not None for n, w in pairs if n is not None)


def dense_block_kernel(block: Block) -> Any | None:  # noqa: ANN401
    """The kernels' DenseBlock for a models/llama.py Block, or None where a piece of it is not
    on our float32 kernels (other dtypes, CUDA, dequantized weights, odd sizes)."""
    norms = [block.attn_norm, block.ffn_norm, block.post_attn_norm, block.post_ffn_norm]
    return block_kernel(block.attn, block.mlp, norms)


def block_kernel(attn: Attention, mlp: GatedMLP, norms: list[RMSNorm | None]) -> Any | None:  # noqa: ANN401
    """The kernels' DenseBlock for an attention, an MLP and the block's norms (attn, ffn,
    post_attn, post_ffn), or None where a piece is not on our float32 kernels. A caller
    that norms q/k/v's input itself (`forward_normed`) still names a norm of that width."""
    if problem() is not None:
        return None
    from specserve.ops.cpu.build import load

    kernels = load()
    qk_norms = [attn.q_norm, attn.k_norm]
    weights = [_norm_weight(n) for n in norms + qk_norms]
    calls = [
        _call(kernels, fused_of((attn.q, attn.k, attn.v))),
        _call(kernels, attn.o),
        _call(kernels, fused_of((mlp.gate, mlp.up))),
        _call(kernels, mlp.down),
    ]
    ok = attn._one_op and _norms_ok(list(zip(norms + qk_norms, weights, strict=True)))
    if not ok or any(c is None for c in calls):
        return None
    first = norms[0]
    assert first is not None  # every block norms its attention's input
    return kernels.DenseBlock(
        *weights[:4],
        first.eps,
        *calls,
        attn.num_heads,
        attn.scale,
        attn.window or 0,
        *weights[4:],
        attn.q_norm.eps if attn.q_norm is not None else 0.0,
        mlp.activation == "silu",
    )
