"""Building the CPU kernels: a killed build must not hang every later load."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from specserve.ops.cpu.build import build_lock

# a process that holds the build folder, says so, then sleeps; argv: folder, seconds
HOLDER = (
    "import sys, time; from pathlib import Path\n"
    "from specserve.ops.cpu.build import build_lock\n"
    "with build_lock(Path(sys.argv[1])):\n"
    "    (Path(sys.argv[1]) / 'lock').touch(); print('held', flush=True)\n"
    "    time.sleep(float(sys.argv[2]))\n"
)


def hold(folder: Path, seconds: float) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), str(seconds)], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"held"
    return proc


def test_torchs_lock_left_by_a_killed_build_is_removed(tmp_path: Path) -> None:
    # a killed build leaves torch's lock file, and every later load waited on it forever
    (tmp_path / "lock").touch()
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_killed_holder_does_not_block_the_next_build(tmp_path: Path) -> None:
    proc = hold(tmp_path, 600)
    try:
        proc.kill()  # as a test run killed mid-build
        proc.wait()
        t0 = time.monotonic()
        with build_lock(tmp_path):
            assert not (tmp_path / "lock").exists()
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_build_in_progress_is_waited_for(tmp_path: Path) -> None:
    proc = hold(tmp_path, 1.5)
    t0 = time.monotonic()
    try:
        with build_lock(tmp_path):
            # the folder was ours only once the holder let go
            assert time.monotonic() - t0 > 1.0
    finally:
        proc.wait()
