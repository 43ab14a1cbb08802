"""Low-bit weight records moved into one buffer that Linux backs with 2 MiB pages.

Why: a decode step reads every weight record once, ~400 MB for the 0.5B, as one sequential
stream per thread. On 4 KiB pages that stream crosses a page, and needs a TLB entry, every
4 KiB; on 2 MiB pages it needs one per 2 MiB. Forwards run faster on huge pages, at the
same steady RSS (figures: docs/perf/memory.md).

Linux gives an anonymous mapping huge pages when asked (madvise MADV_HUGEPAGE) if its
transparent huge pages are "always" or "madvise", as on most distributions. Where they are
"never", or on a system without the call, the records stay where they are.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

from specserve.models.layers.lowbit import LowbitCall
from specserve.trim import release_freed_memory

HUGE_PAGE = 2 << 20
ALIGN = 64  # each record tensor starts on a cache line, as torch's own allocations do
# bytes moved between malloc trims (each is cheap, not free: docs/perf/memory.md)
TRIM_EVERY = 64 << 20


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of nbytes in an anonymous mapping advised for huge pages, starting on a
    2 MiB boundary; None where the system has no such advice."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes <= 0:
        return None
    # one huge page more than asked, so that the tensor can start on a 2 MiB boundary (the
    # pages before it are never touched, so they take no memory)
    # private: Python's default for anonymous maps is shared memory, whose huge pages are a
    # separate setting (shmem_enabled), off on most systems
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # a kernel built without transparent huge pages
        region.close()
        return None
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def record_buffers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, buffer name) of every CPU low-bit weight record tensor: a layer's `records`,
    a fused call's `records_0`, `records_1`, ... (its parts' tensors, the parts replaced)."""
    return [
        (module, name)
        for module in model.modules()
        if isinstance(module, LowbitCall)
        for name, buf in module.named_buffers(recurse=False)
        if name.startswith("records") and buf.device.type == "cpu"
    ]


def records_to_huge_pages(model: nn.Module) -> int:
    """Move every CPU low-bit record tensor into one huge-page buffer; returns its bytes
    (0: nothing moved). The values are copied as they are, so outputs keep their bits."""
    owners = record_buffers(model)
    starts: dict[int, int] = {}  # records' address -> offset: a tensor shared is moved once
    total = 0
    for module, name in owners:
        old = getattr(module, name)
        if old.data_ptr() not in starts:
            starts[old.data_ptr()] = total
            total += -(-old.numel() // ALIGN) * ALIGN
    buffer = huge_page_buffer(total)
    if buffer is None:
        return 0
    moved: dict[int, torch.Tensor] = {}
    untrimmed = 0
    for module, name in owners:
        old = getattr(module, name)
        key = old.data_ptr()
        if key not in moved:
            at = starts[key]
            moved[key] = buffer[at : at + old.numel()].view(old.shape).copy_(old)
            untrimmed += old.numel()
        setattr(module, name, moved[key])
        del old
        if untrimmed >= TRIM_EVERY:
            # the old copies (most below glibc's mmap threshold) go back to the system now,
            # not all at the end, or they all add to the load's peak (docs/perf/memory.md)
            release_freed_memory(collect=False)
            untrimmed = 0
    if untrimmed:  # the copies moved since the last trim
        release_freed_memory(collect=False)
    return total
