"""Shared test fixtures. GPU tests are marked ``gpu`` and skip cleanly without a CUDA device."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def has_gpu() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("cuda") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and cuda-python")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
