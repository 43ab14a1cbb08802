"""The OpenMP spin setting the CLI gives torch before it starts: a default, never an override."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import os, specserve.cli; print(os.environ['GOMP_SPINCOUNT'])"


@pytest.mark.parametrize(("preset", "seen"), [(None, "100000"), ("5", "5")])
def test_gomp_spincount_default(preset: str | None, seen: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if preset is not None:
        env["GOMP_SPINCOUNT"] = preset
    out = subprocess.run(
        [sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == seen
