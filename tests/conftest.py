"""Shared fixtures: real models are pulled once into the user cache and loaded once per session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests.isa import kernel_isas

# Tiny models gain nothing from a second thread, and on a busy 2-core machine OpenMP's
# spinning threads make them up to 50x slower. Real-model fixtures ask for more.
torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS", "1")))


@pytest.fixture()
def real_threads():  # noqa: ANN201
    """Run one real-model test with the machine's cores (at most 2), then back to 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=kernel_isas())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test on each instruction set the CPU kernels have here, then restores the
    default."""
    from specserve.models.layers.lowbit import kernel_isa

    kernel_isa(request.param)
    try:
        yield request.param
    finally:
        kernel_isa("auto")


@pytest.fixture(scope="session")
def qwen05_path():  # noqa: ANN201
    from specserve.loading.sources import pull

    return pull("qwen2.5-coder-0.5b", quiet=True)


@pytest.fixture(scope="session")
def qwen05_f32(qwen05_path):  # noqa: ANN001, ANN201
    from specserve.loading.model import load_model

    return load_model(qwen05_path, "float32")


@pytest.fixture(scope="session")
def qwen05_auto(qwen05_path):  # noqa: ANN001, ANN201
    """The 0.5B as `serve` loads it: float32 activations, the file's low-bit weights."""
    from specserve.loading.model import load_model

    return load_model(qwen05_path, "float32", weights="auto")


@pytest.fixture(scope="session")
def qwen15_f32():  # noqa: ANN201
    """Qwen2.5-Coder-1.5B in float32 (pulled on first use: 1.1 GB), the 0.5B's target."""
    from specserve.loading.model import load_model
    from specserve.loading.sources import pull

    return load_model(pull("qwen2.5-coder-1.5b", quiet=True), "float32")
