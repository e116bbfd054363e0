"""Shared test configuration: the ``gpu`` marker (deselected without a device) and the Triton
interpreter on CPU machines."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run in the CPU interpreter when there is no GPU. It must be set before triton
# is first imported, which is why it lives at conftest import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config: pytest.Config) -> str | None:
    if torch.cuda.is_available():
        return None
    return "gpu-marked tests: deselected (no CUDA/ROCm device; counted as deselected, not skipped)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without a CUDA/ROCm device the ``gpu``-marked tests are deselected: the summary counts
    them in one number ("N deselected") instead of a skip line each. With a device (and without
    ``TRITON_INTERPRET=1``) the ``interpret``-marked tests are deselected instead: they hand the
    Triton kernels CPU tensors, which only the interpreter runs (the GPU tests cover the
    kernels on the device)."""
    if torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            cpu_only = [item for item in items if "interpret" in item.keywords]
            if cpu_only:
                config.hook.pytest_deselected(items=cpu_only)
                items[:] = [item for item in items if "interpret" not in item.keywords]
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if "gpu" not in item.keywords]
