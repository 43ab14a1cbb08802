"""Give memory that finished requests freed back to the operating system.

A step's temporaries (logits, verification rows, drafter tables) are freed by torch, but
glibc's malloc keeps freed heap pages for reuse, so a server's resident memory stays at its
busiest step's high-water mark after the burst is over. When the engine goes idle the loop
calls `release_freed_memory`: a young-generation garbage collection, then glibc's
malloc_trim(0), which returns the free pages at the heap's top and in its arenas. Under
steady load the engine never idles, and each new largest step (verification rows of every
slot beside a prefill) raised the high-water mark again, so the loop also trims, without the
garbage collection (a full one over the speculators' tables stalls a step), every
BUSY_TRIM_S of busy time (figures: docs/perf/memory.md). A no-op where there is no glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache


@cache
def _glibc(function: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), function)
    except (OSError, AttributeError):  # not glibc
        return None


# seconds of busy engine between trims (each is cheap, not free: docs/perf/memory.md)
BUSY_TRIM_S = 20.0


def release_freed_memory(collect: bool = True) -> bool:
    """Collect garbage (if `collect`) and trim malloc's free pages; True if malloc_trim ran."""
    if collect:
        # the young generations only: a full collection holds the GIL for as long as the
        # process has objects, and the event loop waits on the GIL for all of it
        gc.collect(1)
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Have malloc keep what is freed, large blocks too, for the next allocation, and never
    give it back on its own; True if it could be told. For a loop whose every step allocates
    the same large tensors (train-head's logits and gradients, ~100 MB each): glibc serves a
    block over 32 MB from a fresh mapping and unmaps it when freed, so each step faulted
    every page of them in again, zeroed by the kernel (figures: docs/perf/memory.md). Not
    for a server: its memory would stay at its busiest step's (release_freed_memory still
    trims the heap's top)."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
