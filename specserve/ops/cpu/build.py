"""Build the CPU kernels (lowbit.cpp, lowbit_vnni.cpp, attention.cpp, attention_avx512.cpp,
pointwise.cpp, and block.cpp, which chains them into a decoder block) on first use and cache
the library under ~/.cache/specserve/ext.

The kernels need AVX2 + FMA (and F16C, which every AVX2 CPU has) and a C++ compiler (gcc is on every
machine this project targets). `load()` raises a SpecserveError that says which of the two is
missing, so `--weights int8/int6/int5/int4/auto` fails with a reason instead of a stack trace;
callers that can fall back ask `available()` first. lowbit_vnni.cpp and attention_avx512.cpp are
compiled for AVX-512 whatever the CPU (their own `#pragma GCC target`) and run only where the CPU
has it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from specserve.errors import SpecserveError

HERE = Path(__file__).parent
SOURCES = [
    HERE / name
    for name in (
        "module.cpp",
        "lowbit.cpp",
        "lowbit_avx2.cpp",
        "lowbit_vnni.cpp",
        "attention.cpp",
        "attention_avx512.cpp",
        "pointwise.cpp",
        "block.cpp",
    )
]
# -ffp-contract=off: gcc would otherwise fuse a*b+c into an FMA in some tile shapes and
# not in others, and a row's result would depend on the tile it lands in
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    # one folder per source version: an edit rebuilds instead of loading a stale library
    text = b"".join(p.read_bytes() for p in [*SOURCES, *sorted(HERE.glob("*.h"))])
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:12]
    return root / "specserve" / "ext" / f"cpu-{digest}"


def cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


def load() -> ModuleType:
    """The compiled kernels (built on the first call of the process, cached on disk)."""
    result = _build()
    if isinstance(result, SpecserveError):
        raise result
    return result


@cache  # a failed build is remembered too: it is not retried on every layer
def _build() -> ModuleType | SpecserveError:
    try:
        return _compile()
    except SpecserveError as e:
        return e


def _compile() -> ModuleType:
    if not cpu_has_avx2():
        raise SpecserveError("specserve's CPU kernels need a CPU with AVX2, FMA and F16C")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise SpecserveError(
            "specserve's CPU kernels are built on first use and need a C++ compiler"
        )
    from torch.utils.cpp_extension import load as build

    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.glob("*.so")):  # say why the first load pauses
        print("specserve: compiling the CPU kernels (first use, ~2 min)", file=sys.stderr)
    try:
        with build_lock(out):
            return build(
                name="specserve_cpu",
                sources=[str(p) for p in SOURCES],
                extra_cflags=FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(out),
                verbose=False,
            )
    except (RuntimeError, OSError) as e:
        raise SpecserveError(f"building specserve's CPU kernels failed: {e}") from e


@contextlib.contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold the build folder for this process: one build at a time, and torch's own lock
    file, if one is there, was left by a killed build (torch would wait on it forever).

    An flock dies with its process, so a killed build never blocks the next one."""
    with open(out / "specserve.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (out / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def problem() -> str | None:
    """Why the kernels cannot be used here (None: they can)."""
    result = _build()
    return str(result) if isinstance(result, SpecserveError) else None


def available() -> bool:
    return problem() is None


def kernels_for(t: torch.Tensor, *inputs: torch.Tensor) -> ModuleType | None:
    """The kernels when `t` is a float32 CPU tensor and they build here; None otherwise
    (the caller then takes its torch path). None too where autograd records the op and `t`
    or another of its `inputs` (a norm's weight) wants a gradient: the kernels have no
    backward, and a graph cut at a norm trained nothing but an EAGLE-3 head's LM head."""
    if t.dtype != torch.float32 or t.device.type != "cpu":
        return None
    if torch.is_grad_enabled() and any(x.requires_grad for x in (t, *inputs)):
        return None
    result = _build()
    return None if isinstance(result, SpecserveError) else result
