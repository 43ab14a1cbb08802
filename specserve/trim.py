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
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
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
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
