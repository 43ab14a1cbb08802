"""The tiny float64 target the speculation exactness tests share."""

from __future__ import annotations

import pytest
import torch

from specserve.loading.model import load_model
from tests.tiny import write_hf_folder


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """A random-weight qwen2 (seed 11) in float64: greedy ties are as good as impossible."""
    folder = tmp_path_factory.mktemp("target")
    write_hf_folder("qwen2", folder, seed=11)
    return load_model(folder, dtype="float64").model
