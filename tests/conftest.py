"""Shared fixtures: real models are pulled once into the user cache and loaded once per session."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def qwen05_path():  # noqa: ANN201
    from specserve.loading.sources import pull

    return pull("qwen2.5-coder-0.5b", quiet=True)


@pytest.fixture(scope="session")
def qwen05_f32(qwen05_path):  # noqa: ANN001, ANN201
    from specserve.loading.model import load_model

    return load_model(qwen05_path, "float32")
