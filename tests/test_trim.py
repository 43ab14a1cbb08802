"""malloc told to keep freed memory (`keep_freed_memory`): checked in a child process, since
the setting lasts for the whole process that makes it."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

# a 64 MB block, over glibc's largest mmap threshold (32 MB): malloc maps it apart unless told
# not to; mallinfo2's hblks counts such mapped blocks
_CHILD = """
import ctypes, ctypes.util, sys
from specserve.trim import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
        ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
         "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
told = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2().hblks
block = libc.malloc(64 << 20)
print(told, libc.mallinfo2().hblks - before)
"""


def _mapped_blocks(mode: str) -> str:
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    )
    return run.stdout.strip()


def test_keep_freed_memory_serves_large_blocks_from_the_heap() -> None:
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("not glibc 2.33 or newer")
    assert _mapped_blocks("default") == "None 1"  # the default maps the block apart
    assert _mapped_blocks("keep") == "True 0"
