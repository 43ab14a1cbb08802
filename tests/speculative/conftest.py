"""The tiny float64 target (and a close draft model) the speculation exactness tests share."""

from __future__ import annotations

import copy

import pytest
import torch

from specserve.loading.model import load_model
from tests.tiny import add_noise, device_under_test, write_hf_folder


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """A random-weight qwen2 (seed 11) in float64: greedy ties are as good as impossible."""
    folder = tmp_path_factory.mktemp("target")
    write_hf_folder("qwen2", folder, seed=11)
    return load_model(folder, dtype="float64").model.to(device_under_test())


@pytest.fixture(scope="session")
def close_draft(target):  # noqa: ANN001, ANN201
    """The target with a little noise in every weight: agrees often, not always."""
    draft = copy.deepcopy(target)
    add_noise(draft, 0.25)
    return draft
