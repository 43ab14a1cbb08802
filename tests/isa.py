"""The CPU kernels' instruction sets this machine can run, for tests that check each one."""

from __future__ import annotations

from specserve.ops.cpu.build import problem


def kernel_isas() -> list[str]:
    """["avx2"] and, where the CPU has it, "avx512vnni"; [] where the kernels do not build."""
    if problem() is not None:
        return []
    from specserve.models.layers.lowbit import kernel_isa

    best = kernel_isa("auto")
    return ["avx2"] if best == "avx2" else ["avx2", best]
