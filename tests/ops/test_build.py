"""Building the CPU kernels: a killed build must not hang every later load."""

from __future__ import annotations

from pathlib import Path


def test_a_stale_build_lock_is_removed(tmp_path: Path) -> None:
    # a killed build leaves torch's lock file, and every later load waited on it forever
    import os
    import time

    from specserve.ops.cpu.build import STALE_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()  # a build may be running
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
    assert not clear_stale_lock(tmp_path)  # no lock: nothing to do
