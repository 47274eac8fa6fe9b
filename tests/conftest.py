"""Shared test set-up: the shared traces beside the checkout, and the GPU marker's skip."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.paths import SHARED_TRACES


def _cuda_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, f"no CUDA GPU visible to torch {torch.__version__}"
    return True, ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    ok, why = _cuda_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {why}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"the shared traces are not beside this checkout ({SHARED_TRACES})")
    return SHARED_TRACES
