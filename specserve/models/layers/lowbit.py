"""float32 linears on our own low-bit CPU kernels (ops/cpu/lowbit.cpp).

The weights stay in blocks of 32 inputs in memory (q8: int8 + one scale, 1.0625 bytes per
weight; q6: 6-bit + an int8 scale per 16 and a scale, 0.875; q5: 5-bit + scale, 0.6875; q4:
4-bit + scale and low, 0.625; q4k: GGUF Q4_K's own fields, 0.578; scales are float16, as in
GGUF), stored as the kernel's records of 8 outputs x one block (ops/fast/lowbit.py writes
them; ops/naive/lowbit.py holds the layout), so a decode step reads under a third of
float32's bytes in one sequential stream. The kernel quantizes each activation row to int8
per block and runs the block dot products on integers, as llama.cpp does on CPUs
(ops/naive/lowbit.py lowbit_linear is the same arithmetic, written plainly). A row's result
never depends on the other rows of the call, so these layers are batch-invariant as they
stand.

From a GGUF, Q8_0 (on q8) and Q5_0 (on q5) weights come back exactly: the requantization
finds their (float16) scales again. Q4_K and Q6_K blocks become q4k and q6k records as they
are (loading/q4k.py, loading/q6k.py). Other types are re-quantized from their float32 values.
Linears that read the same input run as one call: lowbit_fused.py.

The kernels run on AVX-512 VNNI where the CPU has it and on AVX2 otherwise (`kernel_isa`;
SPECSERVE_CPU_ISA=avx2 forces AVX2); both give the same bits.
"""

from __future__ import annotations

from types import ModuleType
from typing import cast

import torch
from torch import nn

from specserve.ops.cpu.build import load
from specserve.ops.fast.lowbit import (
    q4_records,
    q4k_records,
    q5_records,
    q6_records,
    q6k_records,
    q8_records,
)
from specserve.ops.naive.lowbit import (
    GROUP,
    Q4,
    Q4K,
    Q5,
    Q6,
    Q6K,
    Q8,
    SUPER,
    half_values,
    int4_groups,
    int5_groups,
    int6_groups,
    q8_blocks,
)


def kernel_isa(want: str = "") -> str:
    """The instruction set the low-bit kernels run on ("avx2" or "avx512vnni"); `want` sets
    it ("auto": the best this CPU has). A RuntimeError says when the CPU lacks it."""
    return cast(str, load().lowbit_isa(want))


class LowbitCall(nn.Module):
    """Shape handling and the kernel call over one or more weight matrices (`parts`)."""

    kernels: ModuleType
    bias: nn.Parameter | None
    in_features: int
    out_features: int

    def parts(self) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """(records, kinds, output counts) of the matrices side by side in the output."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:  # the models' case: no reshapes, no casts
            return self.matmul(x)
        rows = x.reshape(-1, self.in_features)
        y = self.matmul(rows.float())
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def matmul(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """rows [M, K] float32 -> [M, N]; into `out` (contiguous [M, N] float32) if given."""
        records, kinds, n_outs = self.parts()
        return self.kernels.lowbit_linear(rows, records, kinds, n_outs, self.bias, out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class LowbitLinear(LowbitCall):
    """One weight matrix; subclasses quantize the weights into records."""

    KIND = -1  # the kernel's number for this kind (ops/cpu/lowbit.cpp RECORD_BYTES)
    # inputs under one scale of x: a block of 32, or a super-block of 256 for the GGUF
    # k-quant kinds (the kernel sums their block dots over it as integers)
    X_GROUP = GROUP
    records: torch.Tensor  # the kernel's tiled blocks (a buffer)

    def __init__(
        self, records: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.kernels = load()
        self.register_buffer("records", records)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), False)

    def parts(self) -> tuple[list[torch.Tensor], list[int], list[int]]:
        return [self.records], [self.KIND], [self.out_features]

    @classmethod
    def from_records(
        cls, records: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None
    ) -> LowbitLinear:
        """A layer of this kind over records made elsewhere (no quantization)."""
        layer = cls.__new__(cls)
        LowbitLinear.__init__(layer, records, out_features, in_features, bias)
        return layer

    @staticmethod
    def check_in_features(weight: torch.Tensor) -> None:
        """A clear error when in_features is not a whole number of blocks of 32."""
        if weight.shape[1] % GROUP:
            raise ValueError(f"low-bit kernels need in_features divisible by {GROUP}")


def writes_into(layer: nn.Module) -> bool:
    """Whether linear_into writes this layer's output into a caller's buffer."""
    return isinstance(layer, LowbitCall)


def linear_into(layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """layer(x), written into `out` ([M, N] float32) where the layer is a low-bit kernel;
    any other layer (float32, CUDA) returns a new tensor as usual."""
    floats = x.dtype == torch.float32 and x.dim() == 2
    if out is not None and writes_into(layer) and floats:
        return cast(LowbitCall, layer).matmul(x, out)
    return cast(torch.Tensor, layer(x))


class Q8Linear(LowbitLinear):
    KIND = Q8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.check_in_features(weight)
        records = q8_records(*q8_blocks(weight))
        super().__init__(records, weight.shape[0], weight.shape[1], bias)


class Q4Linear(LowbitLinear):
    KIND = Q4

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.check_in_features(weight)
        records = q4_records(*int4_groups(weight))
        super().__init__(records, weight.shape[0], weight.shape[1], bias)


class Q5Linear(LowbitLinear):
    KIND = Q5

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.check_in_features(weight)
        q, scale, _ = int5_groups(weight)  # low = -16 scale: the kernel's offset
        super().__init__(q5_records(q, scale), weight.shape[0], weight.shape[1], bias)


class Q6Linear(LowbitLinear):
    """GGUF Q6_K's own values: w = d * sc * (q - 32), q 0..63, an int8 sc per 16 inputs.
    0.875 bytes per weight (Q6_K: 0.82; these tensors ran on q8's 1.0625 before)."""

    KIND = Q6

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.check_in_features(weight)
        records = q6_records(*int6_groups(weight))
        super().__init__(records, weight.shape[0], weight.shape[1], bias)

    @classmethod
    def from_groups(
        cls, q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, bias: torch.Tensor | None
    ) -> Q6Linear:
        """A layer of these values as given (GGUF Q6_K's: loading/q6k.py); d must be float16
        values (Q6_K's are), so nothing is rounded."""
        records = q6_records(q, half_values(d), sc)
        return cast(Q6Linear, cls.from_records(records, q.shape[0], q.shape[1], bias))


class Q6KLinear(LowbitLinear):
    """GGUF Q6_K's own layout: q6's values with d once per 256 inputs, as the file stores it.
    A record holds 8 outputs x 256 inputs: d[8] float16, then each block's q6 record less its
    d. 0.820 bytes per weight (q6, d per block of 32: 0.875). The kernel runs q6's steps on x
    scaled per 256 inputs and sums the 8 block dots as integers under one float step."""

    KIND = Q6K
    X_GROUP = SUPER

    @classmethod
    def from_groups(
        cls, q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, bias: torch.Tensor | None
    ) -> Q6KLinear:
        """A layer of GGUF Q6_K's values (loading/q6k.py q6k_groups): d [N, K/32] must be one
        float16 value per 256 inputs, repeated (as q6k_groups gives it)."""
        records = q6k_records(q, d, sc)
        half_values(d)  # an error if d does not fit float16
        return cast(Q6KLinear, cls.from_records(records, q.shape[0], q.shape[1], bias))


class Q4KLinear(LowbitLinear):
    """GGUF Q4_K's own values: w = d * sc * q - dmin * m, q 0..15, 6-bit sc and m per block of
    32, d and dmin per 256 inputs. One record holds 8 outputs x 256 inputs, so d and dmin are
    stored once per 8 blocks: 0.578 bytes per weight (Q4_K: 0.5625; q4, with a float16 scale
    and low per block: 0.625), and the weights are the file's, where q4 rounds d * sc and
    dmin * m to float16."""

    KIND = Q4K
    X_GROUP = SUPER

    @classmethod
    def from_fields(
        cls,
        q: torch.Tensor,
        sc: torch.Tensor,
        m: torch.Tensor,
        d: torch.Tensor,
        dmin: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> Q4KLinear:
        """A layer of these values as given (loading/q4k.py q4k_fields)."""
        records = q4k_records(q, sc, m, half_values(d), half_values(dmin))
        return cast(Q4KLinear, cls.from_records(records, q.shape[0], q.shape[1], bias))
