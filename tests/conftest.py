"""Shared test configuration: the ``gpu`` marker and the Triton interpreter on CPU machines."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run in the CPU interpreter when there is no GPU. It must be set before triton
# is first imported, which is why it lives at conftest import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
