"""A dense decoder block as one C++ call (ops/cpu/block.cpp) where every piece of it runs on
our float32 CPU kernels: fused low-bit q/k/v and gate/up, low-bit o and down, float32
norms, the one-op attention. The module path makes ~15 Python calls around the same 8
kernels; the kernel block makes one, with the same kernels in the same order (the same bits:
tests/models/test_quant.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from specserve.models.layers.basic import RMSNorm
from specserve.models.layers.lowbit import LowbitCall
from specserve.models.layers.lowbit_fused import fused_of
from specserve.ops.cpu.build import problem

if TYPE_CHECKING:
    from specserve.models.layers.attention import Attention
    from specserve.models.layers.basic import GatedMLP

_UNSET = object()


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


class KernelBlockModule(nn.Module):
    """A module that can run as one kernels' DenseBlock: a llama Block, an EAGLE-3 head's
    layer. The block is made on first use, after the loader has fused the low-bit layers,
    and made again after .to() / .float(), which make new tensors where the block held the
    old ones. Subclasses name its parts (`kernel_parts`); `use_kernel` False keeps the
    modules' path."""

    use_kernel = True

    def __init__(self) -> None:
        super().__init__()
        self._kernel: Any = _UNSET

    def _apply(self, fn: Any, recurse: bool = True) -> KernelBlockModule:  # noqa: ANN401
        self._kernel = _UNSET
        return cast(KernelBlockModule, super()._apply(fn, recurse))

    def kernel_parts(self) -> tuple[Attention, GatedMLP, list[RMSNorm | None]]:
        """The attention, the MLP and the norms (attn, ffn, post_attn, post_ffn)."""
        raise NotImplementedError

    def kernel(self) -> Any:  # noqa: ANN401
        """The kernels' DenseBlock for this module, or None (made once, see the class doc)."""
        if self._kernel is _UNSET:
            self._kernel = block_kernel(*self.kernel_parts())
        return self._kernel

    def kernel_for(self, x: torch.Tensor) -> Any | None:  # noqa: ANN401
        """The block where it is to run on `x` (use_kernel, x float32 on CPU), else None."""
        kernel = self.kernel() if self.use_kernel else None
        return kernel if x.dtype == torch.float32 and x.device.type == "cpu" else None


def block_kernel(attn: Attention, mlp: GatedMLP, norms: list[RMSNorm | None]) -> Any | None:  # noqa: ANN401
    """The kernels' DenseBlock for an attention, an MLP and the block's norms (attn, ffn,
    post_attn, post_ffn), or None where a piece is not on our float32 kernels. A caller
    that norms q/k/v's input itself (`eagle_step`) still names a norm of that width."""
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
