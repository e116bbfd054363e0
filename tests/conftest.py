"""Shared test configuration: the ``gpu`` marker and the Triton interpreter on CPU machines."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run in the CPU interpreter when there is no GPU. It must be set before triton
# is first imported, which is why it lives at conftest import time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_numpy_compat() -> None:
    """Triton 3.6's interpreter turns scalar tensors (1-element arrays) into loop bounds with
    ``int(array)``, which numpy >= 2.4 rejects; read them through ``.item()`` instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_mla_compat", False):
        return

    def patched(tensor: object, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))  # type: ignore[attr-defined]

    patched._mla_compat = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_numpy_compat()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
